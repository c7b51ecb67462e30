"""The liquid-state-machine study end to end (what ``experiments.lsm`` runs): config checks,
spoken-digit data split by voice and its ear + BSA encoding (``corpus``), the reservoir at each
precision, the calcium-rule and least-squares readouts, energy by the power model, simulation
speed against Brian2 (``speed``), and the result files.

Readouts are trained on the tuning voices only. The headline ``accuracy_test_voices`` is
measured on held-out test voices (never seen while tuning); the k-fold cross-validation over
the tuning voices (``accuracy``, secondary: the hyperparameters were tuned on these voices)
also chooses the precision for ``energy_saving_total``. ``config.data.test_wav_dir`` adds
``accuracy_test_dir``: the same trained readout on every labelled WAV of another folder.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.common.config import to_dict
from omni_jax.common.metrics import MetricsLog, write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.data import wav_folder as wf
from omni_jax.lsm import brian2_peer, corpus, plots, power, readout, reservoir, speed
from omni_jax.lsm import fixed_point as fxp


def parse_precision(spec) -> tuple[int, int, int]:
  """(membrane, weight, calcium) widths of a config.bits entry: ``b`` or ``"m/w/c"``."""
  if isinstance(spec, int) and not isinstance(spec, bool):
    widths = (spec, spec, spec)
  elif isinstance(spec, str) and spec.count("/") == 2 and all(
      p.strip().isdigit() for p in spec.split("/")):
    widths = tuple(int(p) for p in spec.split("/"))
  else:
    raise ValueError(f"config.bits contains {spec!r}: an integer width or a "
                     f"'membrane/weight/calcium' string such as '12/8/8' allowed")
  if not all(fxp.MIN_BITS <= b <= fxp.MAX_BITS for b in widths):
    raise ValueError(f"config.bits contains {spec!r}: widths in "
                     f"[{fxp.MIN_BITS}, {fxp.MAX_BITS}] allowed")
  return widths


def validate(cfg) -> None:
  """Clear errors for bad config values, before any work."""
  if cfg.data.corpus not in ("speech", "fsdd"):
    raise ValueError(f"config.data.corpus = {cfg.data.corpus!r}: 'speech' (WAVs: generated or "
                     "config.data.wav_dir) or 'fsdd' (recorded digits as MFCCs) allowed")
  corpus.validate(cfg)
  for b in cfg.bits:
    parse_precision(b)
  if len({str(b) for b in cfg.bits}) != len(cfg.bits):
    raise ValueError(f"config.bits = {tuple(cfg.bits)} repeats an entry")
  if not isinstance(cfg.reference_bits, int) or cfg.reference_bits not in cfg.bits:
    raise ValueError(f"config.reference_bits = {cfg.reference_bits} must be one of "
                     f"config.bits = {tuple(cfg.bits)}")
  if not isinstance(cfg.folds, int) or cfg.folds < 2:
    raise ValueError(f"config.folds = {cfg.folds!r}: an integer >= 2 allowed")
  if cfg.readout.epochs < 1:
    raise ValueError(f"config.readout.epochs = {cfg.readout.epochs}: at least 1")
  if not isinstance(cfg.readout.eval_every, int) or cfg.readout.eval_every < 1:
    raise ValueError(f"config.readout.eval_every = {cfg.readout.eval_every!r}: an integer "
                     f">= 1 allowed")
  if not isinstance(cfg.readout.group, int) or cfg.readout.group < 1:
    raise ValueError(f"config.readout.group = {cfg.readout.group!r}: an integer >= 1 allowed")
  if not 0 < cfg.readout.dw_decay <= 1:
    raise ValueError(f"config.readout.dw_decay = {cfg.readout.dw_decay}: in (0, 1] allowed")
  for name in ("c_init_plus", "lateral"):
    if cfg.readout[name] < 0:
      raise ValueError(f"config.readout.{name} = {cfg.readout[name]}: >= 0 allowed")
  bad = [t for t in cfg.brian2.targets if t not in brian2_peer.TARGETS]
  if bad:
    raise ValueError(f"config.brian2.targets contains {bad}: allowed {list(brian2_peer.TARGETS)}"
                     " (or () to skip the Brian2 peer)")
  if not isinstance(cfg.brian2.utterances, int) or cfg.brian2.utterances < 1:
    raise ValueError(f"config.brian2.utterances = {cfg.brian2.utterances!r}: an integer >= 1 "
                     "allowed")
  if cfg.readout.dc_minus > cfg.readout.c_th:
    raise ValueError(f"config.readout.dc_minus = {cfg.readout.dc_minus} exceeds c_th = "
                     f"{cfg.readout.c_th}: the depression band would include calcium 0 (silent "
                     f"neurons would learn); a value <= c_th (or negative = dc) allowed")

# ---------------------------------------------------------------- model pieces
def lif_params(cfg):
  """Reservoir and readout neuron constants, rule constants."""
  r, o = cfg.reservoir, cfg.readout
  res_lif = reservoir.LIFParams(threshold=r.threshold, tau_shift=r.tau_shift,
                                refractory=r.refractory, syn_shift=r.syn_shift)
  out_lif = reservoir.LIFParams(threshold=o.threshold, tau_shift=o.tau_shift,
                                refractory=o.refractory)
  rule = readout.RuleParams(c_th=o.c_th, dc=o.dc, p_plus=o.p_plus, p_minus=o.p_minus,
                            dw=o.dw, w_max=o.w_max, teacher_plus=o.teacher_plus,
                            teacher_minus=o.teacher_minus, calcium_shift=o.calcium_shift,
                            v_plus=o.v_plus, v_minus=o.v_minus, dc_minus=o.dc_minus,
                            c_init_plus=o.c_init_plus, lateral=o.lateral)
  return res_lif, out_lif, rule


def fmt_for(cfg, spec):
  """Fixed-point format for a config.bits entry (per-quantity widths allowed)."""
  m, w, c = parse_precision(spec)
  return fxp.make_format(m, w, c, ranges={"membrane": cfg.reservoir.membrane_range,
                                          "calcium": cfg.readout.calcium_range})


def draw_streams(cfg, m: int) -> list[np.random.Generator]:
  """Sample-order streams of ``m`` models: rows 0..k-1 (the folds) share the stream the
  k-fold-only study used; extra rows get their own, so adding a model leaves the folds'
  training unchanged."""
  fold_rng = np.random.default_rng(cfg.seed + 1)
  return [fold_rng if j < cfg.folds else np.random.default_rng([cfg.seed + 1, j])
          for j in range(m)]


def epoch_draws(cfg, train_sets, n_train: int, rngs, epoch: int):
  """One epoch's sample order (M, n_train), each row drawn without replacement from its
  ``train_sets`` row, and the models' rule keys (M,)."""
  order = np.stack([rngs[j].permutation(np.flatnonzero(train_sets[j]))[:n_train]
                    for j in range(len(rngs))])
  key = jax.random.key(cfg.seed * 1000 + epoch)
  keys = jnp.concatenate([jax.random.split(key, cfg.folds)]
                         + [jax.random.fold_in(key, j)[None] for j in range(cfg.folds, len(rngs))])
  return order, keys


def train_readouts(cfg, spikes, labels, train_sets, fmt, out_lif, rule, bits, evaluate,
                   metrics):
  """Calcium-rule readouts, one per row of ``train_sets`` (bool (M, S) over the samples of
  ``spikes``), all in parallel (vmap); their final weights (M, N, K).

  Every epoch presents each model n = (smallest row count) samples drawn without replacement
  from its row, so a model trained on all tuning utterances gets the same number of updates
  as a cross-validation fold. ``evaluate(w) -> {name: accuracy}`` is logged every
  ``eval_every`` epochs and at the end (a record, never used to pick anything).
  """
  m = train_sets.shape[0]
  n_train = int(train_sets.sum(1).min())
  rngs = draw_streams(cfg, m)
  s = jnp.asarray(spikes)
  y = jnp.asarray(labels)
  g = cfg.readout.group
  w = jnp.zeros((m, spikes.shape[2], (int(labels.max()) + 1) * g), jnp.float32)
  train_v = jax.jit(jax.vmap(functools.partial(readout.train, group=g),
                             in_axes=(0, 0, None, None, 0, None, None, None)))
  epochs = cfg.readout.epochs
  prog = Progress(f"bits {bits}", epochs, unit="epochs")
  for epoch in range(epochs):
    t0 = time.time()
    order, keys = epoch_draws(cfg, train_sets, n_train, rngs, epoch)
    # Annealed step: dw * dw_decay**epoch (the rule itself is unchanged).
    rule_e = rule._replace(dw=rule.dw * cfg.readout.dw_decay ** epoch)
    w = jax.block_until_ready(train_v(keys, w, s, y, jnp.asarray(order), out_lif, rule_e, fmt))
    dt = time.time() - t0
    if (epoch + 1) % cfg.readout.eval_every and epoch + 1 < epochs:
      prog.update(epoch + 1, f"epochs ({dt:.1f} s)", force=True)
      continue
    accs = evaluate(w)
    prog.update(epoch + 1, "epochs: " + ", ".join(f"{k} {v:.4f}" for k, v in accs.items())
                + f" ({dt:.1f} s/epoch, {m * n_train * spikes.shape[1] / dt:.0f} "
                "sample-steps/s)", force=True)
    # TensorBoard: step = epoch, one series per precision (string fields name the series)
    metrics.write({"series": f"bits {bits}", "bits": bits, "epoch": epoch + 1,
                   "step": epoch + 1, **accs, "seconds": dt})
  return w


def _ls_accuracy(cfg, feats_tr, y_tr, feats_te, y_te) -> float:
  """Ridge least squares fitted on (feats_tr, y_tr), accuracy on (feats_te, y_te)."""
  w = readout.least_squares_fit(feats_tr, y_tr, int(y_tr.max()) + 1, cfg.readout.ls_ridge)
  return float((readout.least_squares_predict(w, feats_te) == y_te).mean())


def least_squares_cv(cfg, feats, labels, fold) -> float:
  """Reference readout accuracy (ridge least squares on spike counts), same folds."""
  hits = sum(_ls_accuracy(cfg, feats[fold != f], labels[fold != f], feats[fold == f],
                          labels[fold == f]) * (fold == f).sum() for f in range(cfg.folds))
  return float(hits / labels.size)


def _ls_spiking_predict(cfg, feats_tr, y_tr, steps, res_te, out_lif, rule):
  """Spiking readout with least-squares weights fitted on (feats_tr, y_tr): predictions."""
  w = readout.least_squares_spiking_weights(feats_tr, y_tr, int(y_tr.max()) + 1, steps,
                                            cfg.readout.ls_ridge)
  return np.asarray(readout.predict(jnp.asarray(w), jnp.asarray(res_te), out_lif, rule,
                                    fxp.make_format(None)))


def least_squares_spiking(cfg, res, lengths, labels, fold, is_test, out_lif, rule):
  """The readout neurons' own reference ceiling: the spiking readout (one LIF neuron per
  class, no teacher) run with least-squares weights. Returns (k-fold accuracy on the tuning
  voices, accuracy on the test voices with weights fitted on all tuning voices; None without
  test voices).

  Float arithmetic, weights unbounded (on our data they reach +-150-180, far beyond the
  rule's w_max and the weight format): it asks what the readout neuron decides with the
  weights that are best for a linear readout, whatever a rule or a word width allows.
  """
  feats = readout.count_features(res, lengths, 1)
  tune = np.flatnonzero(~is_test)
  pred = np.zeros(tune.size, int)
  for f in range(cfg.folds):
    tr, te = tune[fold != f], tune[fold == f]
    pred[fold == f] = _ls_spiking_predict(cfg, feats[tr], labels[tr],
                                          float(lengths[tr].mean()), res[te], out_lif, rule)
  cv = float((pred == labels[tune]).mean())
  if not is_test.any():
    return cv, None
  test = np.flatnonzero(is_test)
  got = _ls_spiking_predict(cfg, feats[tune], labels[tune], float(lengths[tune].mean()),
                            res[test], out_lif, rule)
  return cv, float((got == labels[test]).mean())


def readout_counts(res_tot: reservoir.SimStats, outputs: int) -> power.Counts:
  """Reservoir counts plus the ungated readout (``outputs`` neurons every step)."""
  return power.Counts(updates=res_tot.updates + outputs * res_tot.steps,
                      syn_events=res_tot.syn_events + outputs * res_tot.spikes,
                      syn_updates=res_tot.syn_updates)



# ---------------------------------------------------------------- main


def _reservoir_spikes(net, fmt, spikes, lif):
  """Gated reservoir run: (spikes uint8, per-step stats)."""
  res, st = reservoir.simulate_batch_jit(net, fmt, jnp.asarray(spikes), lif=lif, gate=True)
  return np.asarray(res, np.uint8), st


def _accuracy(pred, labels) -> float | None:
  return float((pred == labels).mean()) if labels.size else None


def run(cfg, workdir: str | Path) -> dict:
  """The whole study on a validated config: data, encoding, reservoir per precision, readouts,
  energy, speed, figures; writes summary.json (and metrics.jsonl, raster.png, confusion.png)
  into ``workdir`` and returns the summary."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  t_start = time.time()
  ds = corpus.load_data(cfg, workdir)
  is_test_ds = corpus.split_voices(cfg, ds)
  if not is_test_ds.any():
    logging.warning("no held-out test voices (config.data.test_voices / test_speakers empty): "
                    "accuracy_test_voices will be null; only the k-fold CV on voices that may "
                    "have been tuned on is reported")
  # Tuning voices first (their encoding, feature scale included, is the one tuned on), then
  # the test voices encoded with the tuning voices' scale.
  sp_tune, len_tune, y_tune, scale = corpus.encode(cfg, corpus.subset(ds, ~is_test_ds), workdir)
  parts = [(sp_tune, len_tune, y_tune)]
  if is_test_ds.any():
    parts.append(corpus.encode(cfg, corpus.subset(ds, is_test_ds), workdir, scale)[:3])
  t_all = max(p[0].shape[1] for p in parts)
  spikes = np.concatenate([corpus.pad_time(p[0], t_all) for p in parts])
  lengths = np.concatenate([p[1] for p in parts])
  labels = np.concatenate([p[2] for p in parts])
  n_tune = y_tune.size
  is_test = np.arange(labels.size) >= n_tune
  y_test = labels[is_test]
  names = [p for p, t in zip(ds.paths, is_test_ds, strict=True) if not t] + \
          [p for p, t in zip(ds.paths, is_test_ds, strict=True) if t]
  dir_ds = corpus.load_test_dir(cfg) if cfg.data.test_wav_dir else None
  if dir_ds is not None:
    sp_dir, len_dir, y_dir, _ = corpus.encode(cfg, dir_ds, workdir, scale)
  fold = corpus.make_folds(y_tune, cfg.folds, cfg.seed)
  # Models: fold f trains on the tuning voices outside fold f; the last on all tuning voices.
  train_sets = np.stack([fold != f for f in range(cfg.folds)] + [np.ones(n_tune, bool)])
  res_lif, out_lif, rule = lif_params(cfg)
  r = cfg.reservoir
  net = reservoir.build_network(cfg.seed, spikes.shape[2], tuple(r.grid), r=r.r,
                                frac_inhibitory=r.frac_inhibitory,
                                inputs_per_channel=r.inputs_per_channel, w_input=r.w_input)
  classes = int(labels.max()) + 1
  outputs = classes * cfg.readout.group
  emodel = power.model_for(r.syn_shift > 0)
  g = cfg.readout.group
  pred_v = jax.jit(jax.vmap(functools.partial(readout.predict, group=g),
                            in_axes=(0, None, None, None, None)), static_argnums=(2, 3))
  out = {k: {} for k in ("cv", "test", "plain", "ls", "ls_test", "energy", "rate", "dir",
                         "ls_dir")}
  ref = {}
  metrics = MetricsLog(str(workdir / "metrics.jsonl"))
  for bits in cfg.bits:
    b = str(bits)
    fmt = fmt_for(cfg, bits)
    res_s, st = _reservoir_spikes(net, fmt, spikes, res_lif)
    # Energy and rate per utterance of the tuning voices (the figures tuned on before).
    tot = reservoir.total_stats(jax.tree.map(lambda a: a[:n_tune], st), len_tune)
    out["rate"][b] = tot.spikes / (tot.steps * net.w_res.shape[0])
    res_tune = res_s[:n_tune, :sp_tune.shape[1]]

    def predictions(w, res_s=res_s, rule=rule, fmt=fmt):
      p = np.asarray(pred_v(w, res_s, out_lif, rule, fmt))            # (models, S)
      return p[fold, np.arange(n_tune)], p[-1, is_test]

    def evaluate(w, predictions=predictions):
      cv, test = predictions(w)
      accs = {"accuracy_cv": _accuracy(cv, y_tune)}
      if y_test.size:
        accs["accuracy_test_voices"] = _accuracy(test, y_test)
      return accs

    w = train_readouts(cfg, res_tune, y_tune, train_sets, fmt, out_lif, rule, bits, evaluate,
                       metrics)
    cv, test = predictions(w)
    out["cv"][b], out["test"][b] = _accuracy(cv, y_tune), _accuracy(test, y_test)
    if rule.lateral > 0:   # the same weights without the test-time lateral inhibition
      out["plain"][b] = _accuracy(predictions(w, rule=rule._replace(lateral=0.0))[0], y_tune)
    feats = readout.count_features(res_s, lengths, 1)
    out["ls"][b] = least_squares_cv(cfg, feats[:n_tune], y_tune, fold)
    out["ls_test"][b] = (_ls_accuracy(cfg, feats[:n_tune], y_tune, feats[is_test], y_test)
                         if y_test.size else None)
    if dir_ds is not None:
      res_dir, _ = _reservoir_spikes(net, fmt, sp_dir, res_lif)
      p = np.asarray(readout.predict(w[-1], jnp.asarray(res_dir), out_lif, rule, fmt, g))
      out["dir"][b] = _accuracy(p, y_dir)
      out["ls_dir"][b] = _ls_accuracy(cfg, feats[:n_tune], y_tune,
                                      readout.count_features(res_dir, len_dir, 1), y_dir)
    m_bits, w_bits, _ = parse_precision(bits)
    out["energy"][b] = power.energy_pj(readout_counts(tot, outputs), m_bits, w_bits, emodel)
    if bits == cfg.reference_bits:
      ung_s, ung_st = reservoir.simulate_batch_jit(net, fmt, jnp.asarray(sp_tune), lif=res_lif,
                                                   gate=False)
      ref["identical"] = bool((np.asarray(ung_s, np.uint8) == res_tune).all())
      ref["ungated"] = reservoir.total_stats(ung_st, len_tune)
      ref["spikes"], ref["cv"], ref["test"] = res_s, cv, test
      ref["ls_spiking"] = least_squares_spiking(cfg, res_s, lengths, labels, fold, is_test,
                                                out_lif, rule)
      logging.info("bits %s: spiking readout with least-squares weights %s (cv, test voices)",
                   bits, ref["ls_spiking"])
    logging.info("bits %s: calcium rule cv %.4f / test voices %s, least squares cv %.4f / test "
                 "voices %s, test dir %s, rate %.4f, energy %.3g pJ", bits, out["cv"][b],
                 out["test"][b], out["ls"][b], out["ls_test"][b], out["dir"].get(b),
                 out["rate"][b], out["energy"][b])
  rb = str(cfg.reference_bits)
  base = power.energy_pj(readout_counts(ref["ungated"], outputs), cfg.reference_bits,
                         cfg.reference_bits, emodel)
  # The precision is chosen on the tuning voices (cross-validation), never on the test voices.
  ok = [b for b in out["cv"] if out["cv"][b] >= out["cv"][rb] - cfg.max_accuracy_loss]
  chosen = min(ok, key=lambda b: out["energy"][b])
  ok_ls = [b for b in out["ls"] if out["ls"][b] >= out["ls"][rb] - cfg.max_accuracy_loss]
  chosen_ls = min(ok_ls, key=lambda b: out["energy"][b])
  single, batched = speed.time_ours(net, fmt_for(cfg, cfg.reference_bits), sp_tune, res_lif,
                                    cfg.speed_repeats)
  b2 = speed.time_brian2(cfg.brian2, net, sp_tune, len_tune, res_lif, workdir)
  ours_b2 = (speed.ours_on_brian2_input(net, sp_tune, len_tune, res_lif, cfg.brian2.utterances)
             if b2["spikes"] else None)  # nothing to compare when no Brian2 target ran
  b2_rates = {k: v for k, v in b2["steps_per_sec"].items() if v}
  b2_best = max(b2_rates, key=b2_rates.get) if b2_rates else None
  cm_cv = np.zeros((classes, classes), int)
  np.add.at(cm_cv, (y_tune, ref["cv"]), 1)
  cm_test = np.zeros((classes, classes), int)
  np.add.at(cm_test, (y_test, ref["test"]), 1)
  i = int(np.argmax(y_tune == 7)) if (y_tune == 7).any() else 0
  plots.raster(str(workdir / "raster.png"), spikes[i, :lengths[i]],
               ref["spikes"][i, :lengths[i]], net.inhibitory,
               f"{Path(names[i]).name}: input (top), reservoir (bottom), {rb}-bit")
  if y_test.size:
    plots.confusion(str(workdir / "confusion.png"), cm_test, wf.DIGITS[:classes],
                    f"calcium-rule readout, {rb}-bit, test voices: {out['test'][rb]:.3f}")
  else:
    plots.confusion(str(workdir / "confusion.png"), cm_cv, wf.DIGITS[:classes],
                    f"calcium-rule readout, {rb}-bit, {cfg.folds}-fold CV: {out['cv'][rb]:.3f}")
  held = corpus.test_speakers(cfg)
  summary = {
      "accuracy_test_voices": out["test"][rb],
      "accuracy_test_voices_by_bits": out["test"],
      "accuracy_least_squares_test_voices_by_bits": out["ls_test"],
      "accuracy_least_squares_spiking_test_voices": ref["ls_spiking"][1],
      "accuracy": out["cv"][rb],
      "accuracy_by_bits": out["cv"],
      "accuracy_note": (f"accuracy / accuracy_by_bits: {cfg.folds}-fold cross-validation on the "
                        f"tuning voices (secondary: the hyperparameters were tuned on these "
                        f"voices); accuracy_test_voices: readout trained on the tuning voices, "
                        f"tested on held-out voices {list(held)}"),
      "accuracy_test_dir": out["dir"].get(rb),
      "accuracy_test_dir_by_bits": out["dir"] if dir_ds is not None else None,
      "accuracy_least_squares_test_dir_by_bits": out["ls_dir"] if dir_ds is not None else None,
      "test_dir": cfg.data.test_wav_dir or None,
      "num_test_dir_files": len(dir_ds.labels) if dir_ds is not None else 0,
      "tuning_speakers": sorted(set(ds.speakers) - set(held)),
      "test_speakers": list(held),
      "num_tuning_utterances": int(n_tune),
      "num_test_voice_utterances": int(y_test.size),
      "energy_saving_gating": power.saving(out["energy"][rb], base),
      "energy_saving_total": power.saving(out["energy"][str(chosen)], base),
      "sim_steps_per_sec": single,
      "brian2_steps_per_sec": b2_rates.get(b2_best),
      "brian2_target": b2_best,
      "brian2_steps_per_sec_by_target": b2["steps_per_sec"],
      "brian2_spikes_by_target": b2["spikes"],
      "brian2_spikes_ours": ours_b2,
      "brian2_note": b2["notes"],
      "brian2_python": b2["python"],
      "speedup_vs_brian2": (single / b2_rates[b2_best]) if b2_best else None,
      "speedup_vs_brian2_numpy": (single / b2_rates["numpy"]) if "numpy" in b2_rates else None,
      "sim_steps_per_sec_batched": batched,
      "accuracy_least_squares_by_bits": out["ls"],
      "accuracy_least_squares_spiking": ref["ls_spiking"][0],
      "chosen_bits_for_total_saving": chosen,
      "accuracy_test_voices_chosen_bits": out["test"][str(chosen)],
      "energy_saving_total_least_squares": power.saving(out["energy"][chosen_ls], base),
      "chosen_bits_least_squares": chosen_ls,
      "energy_pj_by_bits": out["energy"],
      "energy_pj_ungated_reference": base,
      "gated_ungated_spikes_identical": ref["identical"],
      "firing_rate_by_bits": out["rate"],
      "num_utterances": int(labels.size),
      "rejected_files": [list(x) for x in ds.rejected],
      "confusion_matrix": (cm_test if y_test.size else cm_cv).tolist(),
      "confusion_matrix_cv": cm_cv.tolist(),
      "seconds": time.time() - t_start,
      "config": to_dict(cfg),
  }
  if rule.lateral > 0:
    summary["accuracy_without_lateral_by_bits"] = out["plain"]
  write_json_atomic(workdir / "summary.json", summary)
  return summary
