"""The LSM on recorded speech (FSDD MFCCs, ``fsdd``): what ``experiments.lsm`` runs for
``config.data.corpus = "fsdd"``.

Train / validation / test split of recordings (``fsdd.split``); the encoder's statistics come
from the train part. The reservoir runs at every precision of ``config.bits`` and in float.
At each precision a fixed-point linear readout on spike counts in ``config.fsdd.bins`` time
bins (``linear_readout``: trained off-chip by logistic regression, weights rounded to the
precision's weight width, integer inference) is fitted on the train part, its C chosen on
validation. The precision whose validation accuracy is within ``max_accuracy_loss`` of the
reference precision's and whose modelled energy (reservoir + that readout) is lowest is chosen
on validation; ``accuracy_test`` is that fixed-point readout on the test part. The paper's
on-chip calcium rule is trained beside it at the chosen precision and in float (one vmapped
scan over the train utterances laid end to end). Baselines on the same split, each tuned on
validation only: logistic regression on time-pooled MFCCs (no spikes), logistic regression
on the float reservoir's total and binned spike counts, and the calcium rule in float
arithmetic. Brian2 runs the same reservoir on a few train utterances; its spike counts are
compared with ours.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from omni_jax.common.config import to_dict
from omni_jax.common.metrics import MetricsLog, atomic_path, write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm import fsdd, plots, power, readout, reservoir, speed, study
from omni_jax.lsm import linear_readout as lin

FLOAT = "float"
C_GRID = (0.01, 0.1, 1.0, 10.0)


def validate(cfg) -> None:
  """Clear errors for bad fsdd settings (the shared ones are checked by ``study.validate``)."""
  f = cfg.fsdd
  for name in ("test_per_class", "val_per_class", "fields", "steps_per_frame"):
    if not isinstance(f[name], int) or f[name] < 1:
      raise ValueError(f"config.fsdd.{name} = {f[name]!r}: an integer >= 1 allowed")
  if not isinstance(f.train_per_class, int) or f.train_per_class < 0:
    raise ValueError(f"config.fsdd.train_per_class = {f.train_per_class!r}: an integer >= 0 "
                     "allowed (0 = every utterance left after test and validation)")
  if not isinstance(f.bins, int) or not 1 <= f.bins <= 6 * f.steps_per_frame:
    raise ValueError(f"config.fsdd.bins = {f.bins!r}: an integer in [1, "
                     f"{6 * f.steps_per_frame}] allowed (the shortest utterance: 6 frames x "
                     f"steps_per_frame = {f.steps_per_frame} steps)")
  if f.span <= 0:
    raise ValueError(f"config.fsdd.span = {f.span}: > 0 allowed")


def load_encoded(cfg, workdir: Path):
  """Corpus, split, input spikes (S, T, C) and lengths; the encoding is cached by settings."""
  f = cfg.fsdd
  corpus = fsdd.load()
  sp = fsdd.split(corpus.labels, f.test_per_class, f.val_per_class, cfg.seed,
                  f.train_per_class)
  settings = dict(fields=f.fields, span=f.span, steps_per_frame=f.steps_per_frame,
                  bsa_length=cfg.ear.bsa_length, bsa_spike_mass=cfg.ear.bsa_spike_mass,
                  bsa_threshold=cfg.ear.bsa_threshold)
  key = hashlib.sha1(json.dumps([settings, f.test_per_class, f.val_per_class, cfg.seed,
                                 f.train_per_class])
                     .encode()).hexdigest()[:12]
  cache = workdir / f"fsdd_spikes_{key}.npz"
  used = np.sort(np.concatenate(sp))        # only the split's utterances are encoded
  corpus = fsdd.Corpus([corpus.mfccs[i] for i in used], corpus.labels[used])
  sp = fsdd.Split(*[np.searchsorted(used, part) for part in sp])
  if cache.exists():
    z = np.load(cache)
    return corpus, sp, z["spikes"], z["lengths"]
  t0 = time.time()
  enc = fsdd.fit_encoder([corpus.mfccs[i] for i in sp.train], **settings)
  spikes, lengths = fsdd.encode(corpus.mfccs, enc)
  logging.info("fsdd: %d utterances encoded in %.1f s, %d channels, input rate %.4f "
               "spikes/channel/step", len(lengths), time.time() - t0, spikes.shape[2],
               spikes.sum() / (lengths.sum() * spikes.shape[2]))
  with atomic_path(cache) as tmp:
    np.savez(tmp, spikes=spikes, lengths=lengths)
  return corpus, sp, spikes, lengths


def logreg_tuned(x_tr, y_tr, x_va, y_va, x_te, y_te) -> dict:
  """Standardised multinomial logistic regression; C chosen on validation, test accuracy."""
  sc = StandardScaler().fit(x_tr)
  best = None
  for c in C_GRID:
    m = LogisticRegression(C=c, max_iter=2000).fit(sc.transform(x_tr), y_tr)
    acc = float(m.score(sc.transform(x_va), y_va))
    if best is None or acc > best[0]:
      best = (acc, c, m)
  acc, c, m = best
  return {"val": acc, "C": c, "test": float(m.score(sc.transform(x_te), y_te))}


def _stack(trees):
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def train_rule(cfg, res, lengths, labels, train_idx, fmts, out_lif, rule, evaluate, metrics):
  """Calcium-rule readouts, one per precision (``res`` (P, S, T, N), ``fmts`` stacked), trained
  together on the train utterances laid end to end; weights (P, N, K)."""
  p, n = res.shape[0], res.shape[3]
  g = cfg.readout.group
  w = jnp.zeros((p, n, fsdd.NUM_CLASSES * g), jnp.float32)
  train_v = jax.jit(jax.vmap(functools.partial(readout.train_stream, group=g),
                             in_axes=(0, 0, 0, None, None, None, None, 0)))
  rng = np.random.default_rng(cfg.seed + 1)
  prog = Progress("fsdd readout", cfg.readout.epochs, unit="epochs")
  for epoch in range(cfg.readout.epochs):
    t0 = time.time()
    order = rng.permutation(train_idx)
    stream = np.concatenate([res[:, i, :lengths[i]] for i in order], axis=1)
    lab = np.repeat(labels[order], lengths[order])
    starts = np.zeros(lab.size, bool)
    starts[np.concatenate([[0], np.cumsum(lengths[order])[:-1]])] = True
    keys = jax.random.split(jax.random.key(cfg.seed * 1000 + epoch), p)
    rule_e = rule._replace(dw=rule.dw * cfg.readout.dw_decay ** epoch)
    w = jax.block_until_ready(train_v(w, keys, jnp.asarray(stream), jnp.asarray(lab),
                                      jnp.asarray(starts), out_lif, rule_e, fmts))
    dt = time.time() - t0
    if (epoch + 1) % cfg.readout.eval_every and epoch + 1 < cfg.readout.epochs:
      prog.update(epoch + 1, f"epochs ({dt:.1f} s)", force=True)
      continue
    accs = evaluate(w)
    prog.update(epoch + 1, f"epochs: validation {accs} ({dt:.1f} s/epoch)", force=True)
    metrics.write({"epoch": epoch + 1, "step": epoch + 1, "seconds": dt,
                   **{f"accuracy_val/{k}": v for k, v in accs.items()}})
  return w


def simulate_all(cfg, net, spikes, lengths, train, res_lif, specs, fmts):
  """Gated reservoir spikes at every precision, (P, S, T, N) uint8; the train part's operation
  totals per precision; the ungated reference run's totals and whether its spikes equal the
  gated run's."""
  res, tots, ref = [], [], {}
  for spec, fmt in zip(specs, fmts, strict=True):
    s, st = reservoir.simulate_batch_jit(net, fmt, jnp.asarray(spikes), lif=res_lif, gate=True)
    res.append(np.asarray(s, np.uint8))
    tots.append(reservoir.total_stats(jax.tree.map(lambda a: a[train], st), lengths[train]))
    if spec == cfg.reference_bits:
      ung, ung_st = reservoir.simulate_batch_jit(net, fmt, jnp.asarray(spikes[train]),
                                                 lif=res_lif, gate=False)
      ref["identical"] = bool((np.asarray(ung, np.uint8) == res[-1][train]).all())
      ref["ungated"] = reservoir.total_stats(ung_st, lengths[train])
    logging.info("reservoir %s: rate %.4f spikes/neuron/step", spec,
                 tots[-1].spikes / (tots[-1].steps * net.w_res.shape[0]))
  return np.stack(res), tots, ref


def fit_linear(cfg, res, lengths, y, sp, specs, refractory) -> list[dict]:
  """Per precision: the binned counts' logistic regression (C on validation), rounded to the
  precision's weight width (float reservoir: float weights only), its accumulator width and
  the predictions on validation and test of the integer and the float weights."""
  cap = lin.max_spikes(res.shape[3], res.shape[2], refractory)
  out = []
  for i, spec in enumerate(specs):
    x = lin.binned_counts(res[i], lengths, cfg.fsdd.bins)
    fl = lin.fit(x[sp.train], y[sp.train], x[sp.val], y[sp.val], C_GRID)
    o = {"float": fl, "val_float": lin.predict_float(x[sp.val], fl),
         "test_float": lin.predict_float(x[sp.test], fl)}
    if spec is not None:
      q = lin.quantize(fl, study.parse_precision(spec)[1])
      o.update(int=q, acc_bits=lin.acc_bits(q, cap), val=lin.predict(x[sp.val], q),
               test=lin.predict(x[sp.test], q))
    logging.info("linear readout %s: C %s, validation %s", spec, fl.c, fl.val_by_c)
    out.append(o)
  return out


def _acc(pred, labels) -> float:
  return float((pred == labels).mean())


def run(cfg, workdir: str | Path) -> dict:
  """The fsdd study end to end; writes summary.json, metrics.jsonl, raster.png,
  confusion.png and precision.png into ``workdir`` and returns the summary."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  t_start = time.time()
  corpus, sp, spikes, lengths = load_encoded(cfg, workdir)
  y = corpus.labels
  r = cfg.reservoir
  net = reservoir.build_network(cfg.seed, spikes.shape[2], tuple(r.grid), r=r.r,
                                frac_inhibitory=r.frac_inhibitory,
                                inputs_per_channel=r.inputs_per_channel, w_input=r.w_input)
  n_res, k = net.w_res.shape[0], fsdd.NUM_CLASSES
  res_lif, out_lif, rule = study.lif_params(cfg)
  emodel = power.model_for(r.syn_shift > 0)
  specs = list(cfg.bits) + [None]
  names = [str(b) for b in cfg.bits] + [FLOAT]
  fmts = [study.fmt_for(cfg, b) for b in cfg.bits] + [fxp.make_format(None)]
  res, tots, ref = simulate_all(cfg, net, spikes, lengths, sp.train, res_lif, specs, fmts)
  rate = {n: t.spikes / (t.steps * n_res) for n, t in zip(names, tots, strict=True)}
  lino = fit_linear(cfg, res, lengths, y, sp, specs, res_lif.refractory)
  n_tr = sp.train.size

  def energy_of(tot, spec, acc_bits):    # per utterance: gated reservoir + linear readout
    m_bits, w_bits, _ = study.parse_precision(spec)
    ro = power.linear_readout_counts(tot.steps, tot.spikes, n_tr, n_res, k)
    return (power.energy_pj(study.readout_counts(tot, 0), m_bits, w_bits, emodel)
            + power.linear_readout_pj(ro, w_bits, acc_bits)) / n_tr

  fixed = names[:-1]
  energy = {n: energy_of(tots[i], specs[i], lino[i]["acc_bits"]) for i, n in enumerate(fixed)}
  rb = str(cfg.reference_bits)
  ri = names.index(rb)
  base = energy_of(ref["ungated"], cfg.reference_bits, lino[ri]["acc_bits"])
  acc_val = {n: _acc(lino[i]["val"], y[sp.val]) for i, n in enumerate(fixed)}
  acc_test = {n: _acc(lino[i]["test"], y[sp.test]) for i, n in enumerate(fixed)}
  ok = [n for n in fixed if acc_val[n] >= acc_val[rb] - cfg.max_accuracy_loss]
  chosen = min(ok, key=lambda n: energy[n])
  ci = names.index(chosen)
  # The paper's on-chip calcium rule at the chosen precision and in float.
  rule_idx = [ci, len(names) - 1]
  res_rule, fmt_rule = res[rule_idx], _stack([fmts[i] for i in rule_idx])
  g = cfg.readout.group
  pred_v = jax.jit(jax.vmap(functools.partial(readout.predict, group=g),
                            in_axes=(0, 0, None, None, 0)), static_argnums=(2, 3))

  def predict(w, idx):
    return np.asarray(pred_v(w, jnp.asarray(res_rule[:, idx]), out_lif, rule, fmt_rule))

  def evaluate(w):
    p = predict(w, sp.val)
    return {names[j]: round(_acc(p[i], y[sp.val]), 4) for i, j in enumerate(rule_idx)}

  metrics = MetricsLog(str(workdir / "metrics.jsonl"))
  w = train_rule(cfg, res_rule, lengths, y, sp.train, fmt_rule, out_lif, rule, evaluate,
                 metrics)
  rule_val, rule_test = predict(w, sp.val), predict(w, sp.test)
  # Baselines, tuned on validation.
  pooled = fsdd.pooled_features(corpus.mfccs)
  lr_mfcc = logreg_tuned(pooled[sp.train], y[sp.train], pooled[sp.val], y[sp.val],
                         pooled[sp.test], y[sp.test])
  counts = readout.count_features(res[-1], lengths, 1)
  lr_res = logreg_tuned(counts[sp.train], y[sp.train], counts[sp.val], y[sp.val],
                        counts[sp.test], y[sp.test])
  # Brian2: the same reservoir on the first train utterances, spike counts against ours.
  b2 = speed.time_brian2(cfg.brian2, net, spikes[sp.train], lengths[sp.train], res_lif, workdir)
  ours_b2 = speed.ours_on_brian2_input(net, spikes[sp.train], lengths[sp.train], res_lif,
                                       cfg.brian2.utterances)
  single, _ = speed.time_ours(net, study.fmt_for(cfg, cfg.reference_bits), spikes[sp.train[:8]],
                              res_lif, cfg.speed_repeats)
  b2_rates = {kk: v for kk, v in b2["steps_per_sec"].items() if v}
  b2_best = max(b2_rates, key=b2_rates.get) if b2_rates else None
  cm = np.zeros((k, k), int)
  np.add.at(cm, (y[sp.test], lino[ci]["test"]), 1)
  i = int(sp.train[np.argmax(y[sp.train] == 7)])
  plots.raster(str(workdir / "raster.png"), spikes[i, :lengths[i]],
               res[ri, i, :lengths[i]], net.inhibitory,
               f"FSDD utterance {i} (digit 7): input (top), reservoir (bottom), {rb}-bit",
               step=f"1/{cfg.fsdd.steps_per_frame} MFCC frame")
  plots.confusion(str(workdir / "confusion.png"), cm, [str(d) for d in range(10)],
                  f"linear readout, {cfg.fsdd.bins} bins, {chosen}-bit, FSDD test: "
                  f"{acc_test[chosen]:.3f}")
  m_c, w_c, _ = study.parse_precision(specs[ci])
  rule_energy = power.energy_pj(study.readout_counts(tots[ci], k * g), m_c, w_c, emodel) / n_tr
  plots.precision(str(workdir / "precision.png"), fixed, acc_val, acc_test,
                  [energy[n] / base for n in fixed],
                  f"FSDD, linear readout ({cfg.fsdd.bins} bins): accuracy and modelled energy")
  ro_ops = power.linear_readout_counts(tots[ci].steps, tots[ci].spikes, n_tr, n_res, k)
  summary = {
      "accuracy_test": acc_test[chosen],
      "accuracy_val": acc_val[chosen],
      "chosen_bits": chosen,
      "accuracy_test_by_bits": acc_test,
      "accuracy_val_by_bits": acc_val,
      "readout": f"linear, {cfg.fsdd.bins} time bins",
      "readout_note": ("off-chip training, fixed-point inference: logistic regression in float "
                       "on the train part's binned spike counts (C on validation), weights "
                       "and bias rounded to the precision's weight width, integer "
                       "accumulation (omni_jax/lsm/linear_readout.py); not the paper's "
                       "on-chip calcium rule (accuracy_test_calcium_rule)"),
      "readout_C_by_bits": {n: lino[i]["float"].c for i, n in enumerate(names)},
      "readout_acc_bits_by_bits": {n: lino[i]["acc_bits"] for i, n in enumerate(fixed)},
      "accuracy_val_float_weights_by_bits": {n: _acc(lino[i]["val_float"], y[sp.val])
                                             for i, n in enumerate(fixed)},
      "accuracy_test_float_weights_by_bits": {n: _acc(lino[i]["test_float"], y[sp.test])
                                              for i, n in enumerate(fixed)},
      "accuracy_test_calcium_rule": _acc(rule_test[0], y[sp.test]),
      "accuracy_val_calcium_rule": _acc(rule_val[0], y[sp.val]),
      "baselines": {"logreg_pooled_mfcc": lr_mfcc["test"],
                    "reservoir_float_logreg_counts": lr_res["test"],
                    "reservoir_float_logreg_binned": _acc(lino[-1]["test_float"], y[sp.test]),
                    "reservoir_float_calcium_rule": _acc(rule_test[1], y[sp.test])},
      "baselines_val": {"logreg_pooled_mfcc": lr_mfcc["val"],
                        "reservoir_float_logreg_counts": lr_res["val"],
                        "reservoir_float_logreg_binned": _acc(lino[-1]["val_float"], y[sp.val]),
                        "reservoir_float_calcium_rule": _acc(rule_val[1], y[sp.val])},
      "baselines_C": {"logreg_pooled_mfcc": lr_mfcc["C"],
                      "reservoir_float_logreg_counts": lr_res["C"],
                      "reservoir_float_logreg_binned": lino[-1]["float"].c},
      "energy_saving_gating": power.saving(energy[rb], base),
      "energy_saving_total": power.saving(energy[chosen], base),
      "energy_pj_by_bits": energy,
      "energy_pj_ungated_reference": base,
      "energy_pj_calcium_rule_design": rule_energy,
      "readout_ops_per_utterance": {kk: v / n_tr for kk, v in ro_ops._asdict().items()},
      "energy_note": ("modelled (omni_jax/lsm/power.py: operation counts of the simulation x "
                      "per-bit costs), per utterance (mean over the train part): gated "
                      "reservoir + linear readout, relative to the ungated design at "
                      f"{rb} bits with the {rb}-bit readout; energy_pj_calcium_rule_design: "
                      f"the gated reservoir + the calcium rule's {k * g} spiking readout "
                      f"neurons at {chosen} bits"),
      "gated_ungated_spikes_identical": ref["identical"],
      "firing_rate_by_bits": rate,
      "split": {"train": int(sp.train.size), "val": int(sp.val.size),
                "test": int(sp.test.size), "seed": cfg.seed},
      "split_note": ("drawn per digit with a seeded permutation (test, then validation, then "
                     "train); the file has no speaker or recording index and its order does "
                     "not recover FSDD's standard split (order_statistics)"),
      "order_statistics": fsdd.order_statistics(fsdd.load()),
      "input_channels": int(spikes.shape[2]),
      "brian2_spikes_by_target": b2["spikes"],
      "brian2_spikes_ours": ours_b2,
      "brian2_note": b2["notes"],
      "brian2_steps_per_sec": b2_rates.get(b2_best),
      "brian2_target": b2_best,
      "sim_steps_per_sec": single,
      "num_utterances": int(y.size),
      "confusion_matrix": cm.tolist(),
      "seconds": time.time() - t_start,
      "config": to_dict(cfg),
  }
  write_json_atomic(workdir / "summary.json", summary)
  return summary
