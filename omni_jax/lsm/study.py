"""The liquid-state-machine study end to end (what ``experiments.lsm`` runs): config checks,
spoken-digit data and its ear + BSA encoding (cached), the reservoir at each precision, the
calcium-rule and least-squares readouts under k-fold cross-validation, energy by the power
model, simulation speed against Brian2, and the result files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.config import to_dict
from omni_jax.lsm import brian2_env, brian2_peer, ear, plots, power, readout, reservoir, speech
from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm import wav_folder as wf
from omni_jax.train.metrics import MetricsLog, atomic_path, write_json_atomic
from omni_jax.train.progress import Progress


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


# ---------------------------------------------------------------- data
def load_data(cfg, workdir: Path) -> wf.Dataset:
  """Labelled WAVs from config.data.wav_dir, else generated with espeak-ng (cached)."""
  d = cfg.data
  if d.wav_dir:
    folder = Path(d.wav_dir)
  else:
    folder = Path(d.cache_dir) if d.cache_dir else workdir / "wavs"
    spec = speech.SpeechSpec(voices=tuple(d.voices), utterances=d.utterances,
                             speed_wpm=tuple(d.speed_wpm), pitch=tuple(d.pitch),
                             snr_db=tuple(d.snr_db), rt60_s=tuple(d.rt60_s),
                             sample_rate=d.sample_rate, seed=cfg.seed)
    speech.generate_digits(folder, spec)
  ds = wf.load_folder(folder, checks=wf.WavChecks(sample_rate=d.sample_rate))
  for path, reason in ds.rejected:
    logging.warning("rejected %s: %s", path, reason)
  for path, note in ds.notes:
    logging.info("%s: %s", path, note)
  if len(set(ds.labels)) < 2 or len(ds.labels) < cfg.folds * 2:
    raise ValueError(f"{folder}: only {len(ds.labels)} usable labelled files in "
                     f"{len(set(ds.labels))} classes; need >= {2 * cfg.folds} in >= 2")
  return ds


def encode(cfg, ds: wf.Dataset, workdir: Path):
  """Input spike trains (S, T, C) uint8, frame lengths, labels; cached by content hash."""
  e = cfg.ear
  key = hashlib.sha1(json.dumps([to_dict(e), ds.paths, ds.sample_rate]).encode()).hexdigest()
  cache = workdir / f"features_{key[:12]}.npz"
  if cache.exists():
    z = np.load(cache)
    return z["spikes"], z["lengths"], z["labels"], float(z["scale"])
  p = ear.EarParams(sample_rate=ds.sample_rate, num_channels=e.num_channels, f_lo=e.f_lo,
                    f_hi=e.f_hi, decimation=e.decimation)
  cas = ear.design_cascade(p)
  waves, lengths = wf.pad_batch(ds.waves, p.decimation)
  t0 = time.time()
  feats = jax.jit(jax.vmap(lambda w: ear.ear_features(w, cas, p)))(jnp.asarray(waves))
  scale = float(np.percentile(np.asarray(feats), e.scale_percentile))
  kern = ear.bsa_kernel(e.bsa_length, e.bsa_spike_mass)
  spikes = jax.jit(jax.vmap(lambda f: ear.bsa_encode(f / scale, kern, e.bsa_threshold)))(feats)
  spikes = np.asarray(spikes, np.uint8)[:, :int(lengths.max())]
  logging.info("ear + BSA: %d utterances in %.1f s, input rate %.4f spikes/channel/step",
               len(waves), time.time() - t0, spikes.sum() / (lengths.sum() * e.num_channels))
  labels = np.asarray(ds.labels)
  with atomic_path(cache) as tmp:
    np.savez(tmp, spikes=spikes, lengths=lengths, labels=labels, scale=scale)
  return spikes, lengths, labels, scale


def make_folds(labels: np.ndarray, k: int, seed: int) -> np.ndarray:
  """Stratified fold id per sample."""
  rng = np.random.default_rng(seed)
  fold = np.zeros(labels.size, int)
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    fold[idx] = np.arange(idx.size) % k
  return fold


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


def train_folds(cfg, spikes, labels, fold, fmt, out_lif, rule, bits, metrics):
  """Calcium-rule readout, all folds in parallel (vmap); per-sample predictions of the final
  weights, with and without the test-time lateral inhibition (equal when it is off)."""
  k = cfg.folds
  n_train = min(int((fold != f).sum()) for f in range(k))
  rng = np.random.default_rng(cfg.seed + 1)
  s = jnp.asarray(spikes)
  y = jnp.asarray(labels)
  n = spikes.shape[2]
  g = cfg.readout.group
  w = jnp.zeros((k, n, (int(labels.max()) + 1) * g), jnp.float32)
  train_v = jax.jit(jax.vmap(functools.partial(readout.train, group=g),
                             in_axes=(0, 0, None, None, 0, None, None, None)))
  pred_v = jax.jit(jax.vmap(functools.partial(readout.predict, group=g),
                            in_axes=(0, None, None, None, None)), static_argnums=(2, 3))
  preds = None
  epochs = cfg.readout.epochs
  prog = Progress(f"bits {bits}", epochs, unit="epochs")
  for epoch in range(epochs):
    t0 = time.time()
    order = np.stack([rng.permutation(np.flatnonzero(fold != f))[:n_train] for f in range(k)])
    keys = jax.random.split(jax.random.key(cfg.seed * 1000 + epoch), k)
    # Annealed step: dw * dw_decay**epoch (the rule itself is unchanged).
    rule_e = rule._replace(dw=rule.dw * cfg.readout.dw_decay ** epoch)
    w = jax.block_until_ready(train_v(keys, w, s, y, jnp.asarray(order), out_lif, rule_e, fmt))
    if (epoch + 1) % cfg.readout.eval_every and epoch + 1 < epochs:
      prog.update(epoch + 1, f"epochs ({time.time() - t0:.1f} s)", force=True)
      continue
    all_pred = np.asarray(pred_v(w, s, out_lif, rule, fmt))       # (folds, S)
    preds = all_pred[fold, np.arange(labels.size)]
    acc = float((preds == labels).mean())
    dt = time.time() - t0
    prog.update(epoch + 1, f"epochs: cv accuracy {acc:.4f} ({dt:.1f} s/epoch, "
                f"{k * n_train * spikes.shape[1] / dt:.0f} sample-steps/s)", force=True)
    # TensorBoard: step = epoch, one series per precision (string fields name the series)
    metrics.write({"series": f"bits {bits}", "bits": bits, "epoch": epoch + 1,
                   "step": epoch + 1, "accuracy": acc, "seconds": dt})
  preds_plain = preds
  if rule.lateral > 0:   # the same weights without the test-time lateral inhibition
    plain = np.asarray(pred_v(w, s, out_lif, rule._replace(lateral=0.0), fmt))
    preds_plain = plain[fold, np.arange(labels.size)]
    logging.info("bits %s: accuracy without lateral inhibition %.4f (with %.4f)", bits,
                 float((preds_plain == labels).mean()), float((preds == labels).mean()))
  return preds, preds_plain


def least_squares_cv(cfg, res_spikes, lengths, labels, fold):
  """Reference readout accuracy (ridge least squares on spike counts), same folds."""
  feats = readout.count_features(res_spikes, lengths, 1)
  pred = np.zeros_like(labels)
  for f in range(cfg.folds):
    tr, te = fold != f, fold == f
    w = readout.least_squares_fit(feats[tr], labels[tr], int(labels.max()) + 1,
                                  cfg.readout.ls_ridge)
    pred[te] = readout.least_squares_predict(w, feats[te])
  return float((pred == labels).mean())


def least_squares_spiking_cv(cfg, res_spikes, lengths, labels, fold, out_lif, rule):
  """The readout neurons' own reference ceiling: the spiking readout (one LIF neuron per
  class, no teacher) run with least-squares weights fitted on each fold's training counts.

  Float arithmetic, weights unbounded (on our data they reach +-150-180, far beyond the
  rule's w_max and the weight format): it asks what the readout neuron decides with the
  weights that are best for a linear readout, whatever a rule or a word width allows.
  """
  feats = readout.count_features(res_spikes, lengths, 1)
  classes = int(labels.max()) + 1
  fmt = fxp.make_format(None)
  pred = np.zeros_like(labels)
  s = jnp.asarray(res_spikes)
  for f in range(cfg.folds):
    tr, te = fold != f, fold == f
    w = readout.least_squares_spiking_weights(feats[tr], labels[tr], classes,
                                              float(lengths[tr].mean()), cfg.readout.ls_ridge)
    pred[te] = np.asarray(readout.predict(jnp.asarray(w), s[np.flatnonzero(te)], out_lif,
                                          rule, fmt))
  return float((pred == labels).mean())


def readout_counts(res_tot: reservoir.SimStats, outputs: int) -> power.Counts:
  """Reservoir counts plus the ungated readout (``outputs`` neurons every step)."""
  return power.Counts(updates=res_tot.updates + outputs * res_tot.steps,
                      syn_events=res_tot.syn_events + outputs * res_tot.spikes,
                      syn_updates=res_tot.syn_updates)


# ---------------------------------------------------------------- speed
def time_ours(net, fmt, spikes, lif, repeats):
  """Single-stream and batched reservoir steps per second (compile excluded)."""
  one = jnp.asarray(spikes[:1])
  f = reservoir.simulate_batch_jit
  jax.block_until_ready(f(net, fmt, one, lif=lif))
  t0 = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(f(net, fmt, one, lif=lif))
  single = repeats * one.shape[1] / (time.perf_counter() - t0)
  allb = jnp.asarray(spikes)
  jax.block_until_ready(f(net, fmt, allb, lif=lif))
  t0 = time.perf_counter()
  jax.block_until_ready(f(net, fmt, allb, lif=lif))
  batched = allb.shape[0] * allb.shape[1] / (time.perf_counter() - t0)
  return single, batched


def time_brian2(cfg, net, spikes, lengths, lif, workdir: Path) -> dict:
  """The same reservoir in Brian2, timed on each of ``config.brian2.targets``.

  Brian2 runs in its own interpreter (``brian2_env``: this one if Brian2 imports here, else a
  venv the experiment creates on first use). Returns ``{"steps_per_sec": {target: steps/s or
  None}, "spikes": {target: count}, "notes": {target: what happened}, "python": how the
  interpreter was found}``.
  """
  b = cfg.brian2
  res = {"steps_per_sec": {}, "spikes": {}, "notes": {}, "python": None}
  if not b.targets:
    res["python"] = "not measured: config.brian2.targets is empty"
    return res
  try:
    exe, res["python"] = brian2_env.brian2_python(b.venv)
  except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
    res["python"] = f"no Brian2 interpreter: {e}"
    logging.warning("Brian2 peer not measured: %s", e)
    for target in b.targets:
      res["steps_per_sec"][target] = None
      res["notes"][target] = res["python"]
    return res
  u = min(b.utterances, spikes.shape[0])
  t = int(lengths[:u].max())
  npz = workdir / "brian2_net.npz"
  np.savez(npz, w_in=net.w_in, w_res=net.w_res, in_spikes=spikes[:u, :t],
           tau_shift=lif.tau_shift, syn_shift=lif.syn_shift, threshold=lif.threshold,
           refractory=lif.refractory)
  script = Path(__file__).resolve().parent / "brian2_peer.py"
  for target in b.targets:
    out = workdir / f"brian2_speed_{target}.json"
    out.unlink(missing_ok=True)
    logging.info("Brian2 %s target: %d utterances x %d steps (code generation and compilation "
                 "not timed; Cython / C++ compile once, ~1-2 min)", target, u, t)
    t0 = time.time()
    try:
      run_ = subprocess.run([exe, str(script), str(npz), str(out), target], capture_output=True,
                            text=True, timeout=b.timeout_s)
    except subprocess.TimeoutExpired:
      note = f"exceeded config.brian2.timeout_s = {b.timeout_s} s"
      run_ = None
    if run_ is not None and run_.returncode == 0 and out.exists():
      got = json.loads(out.read_text())
      res["steps_per_sec"][target] = got["steps_per_sec"]
      res["spikes"][target] = got["spikes"]
      note = (f"measured, Brian2 {got['brian2_version']}, {got['steps']} steps in "
              f"{got['seconds']:.4g} s ({time.time() - t0:.0f} s with code generation)")
    else:
      res["steps_per_sec"][target] = None
      if run_ is not None:
        note = f"failed: {run_.stderr.strip()[-400:]}"
    res["notes"][target] = note
    logging.info("Brian2 %s: %s steps/s (%s)", target, res["steps_per_sec"][target], note)
  return res


# ---------------------------------------------------------------- main


def run(cfg, workdir: str | Path) -> dict:
  """The whole study on a validated config: data, encoding, reservoir per precision, readouts,
  energy, speed, figures; writes summary.json (and metrics.jsonl, raster.png, confusion.png)
  into ``workdir`` and returns the summary."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  t_start = time.time()
  ds = load_data(cfg, workdir)
  spikes, lengths, labels, _ = encode(cfg, ds, workdir)
  fold = make_folds(labels, cfg.folds, cfg.seed)
  res_lif, out_lif, rule = lif_params(cfg)
  r = cfg.reservoir
  net = reservoir.build_network(cfg.seed, spikes.shape[2], tuple(r.grid), r=r.r,
                                frac_inhibitory=r.frac_inhibitory,
                                inputs_per_channel=r.inputs_per_channel, w_input=r.w_input)
  classes = int(labels.max()) + 1
  outputs = classes * cfg.readout.group
  emodel = power.model_for(r.syn_shift > 0)
  acc_bits, ls_bits, energy_bits, rates, plain_bits = {}, {}, {}, {}, {}
  ref = {}
  metrics = MetricsLog(workdir / "metrics.jsonl")
  for bits in cfg.bits:
    fmt = fmt_for(cfg, bits)
    res_s, st = reservoir.simulate_batch_jit(net, fmt, jnp.asarray(spikes), lif=res_lif,
                                             gate=True)
    res_s = np.asarray(res_s, np.uint8)
    tot = reservoir.total_stats(st, lengths)
    rates[str(bits)] = tot.spikes / (tot.steps * net.w_res.shape[0])
    if bits == cfg.reference_bits:
      ung_s, ung_st = reservoir.simulate_batch_jit(net, fmt, jnp.asarray(spikes),
                                                   lif=res_lif, gate=False)
      ref["identical"] = bool((np.asarray(ung_s, np.uint8) == res_s).all())
      ref["ungated"] = reservoir.total_stats(ung_st, lengths)
      ref["spikes"] = res_s
    preds, preds_plain = train_folds(cfg, res_s, labels, fold, fmt, out_lif, rule, bits,
                                     metrics)
    acc_bits[str(bits)] = float((preds == labels).mean())
    plain_bits[str(bits)] = float((preds_plain == labels).mean())
    ls_bits[str(bits)] = least_squares_cv(cfg, res_s, lengths, labels, fold)
    m_bits, w_bits, _ = parse_precision(bits)
    energy_bits[str(bits)] = power.energy_pj(readout_counts(tot, outputs), m_bits, w_bits,
                                             emodel)
    if bits == cfg.reference_bits:
      ref["preds"] = preds
      ref["ls_spiking"] = least_squares_spiking_cv(cfg, res_s, lengths, labels, fold,
                                                   out_lif, rule)
      logging.info("bits %s: spiking readout with least-squares weights %.4f", bits,
                   ref["ls_spiking"])
    logging.info("bits %s: calcium-rule acc %.4f, least-squares acc %.4f, rate %.4f, "
                 "energy %.3g pJ", bits, acc_bits[str(bits)], ls_bits[str(bits)],
                 rates[str(bits)], energy_bits[str(bits)])
  rb = str(cfg.reference_bits)
  base = power.energy_pj(readout_counts(ref["ungated"], outputs), cfg.reference_bits,
                         cfg.reference_bits, emodel)
  ok = [b for b in acc_bits if acc_bits[b] >= acc_bits[rb] - cfg.max_accuracy_loss]
  chosen = min(ok, key=lambda b: energy_bits[b])
  ok_ls = [b for b in ls_bits if ls_bits[b] >= ls_bits[rb] - cfg.max_accuracy_loss]
  chosen_ls = min(ok_ls, key=lambda b: energy_bits[b])
  single, batched = time_ours(net, fmt_for(cfg, cfg.reference_bits), spikes, res_lif,
                              cfg.speed_repeats)
  b2 = time_brian2(cfg, net, spikes, lengths, res_lif, workdir)
  b2_rates = {k: v for k, v in b2["steps_per_sec"].items() if v}
  b2_best = max(b2_rates, key=b2_rates.get) if b2_rates else None
  cm = np.zeros((classes, classes), int)
  np.add.at(cm, (labels, ref["preds"]), 1)
  i = int(np.argmax(labels == 7)) if (labels == 7).any() else 0
  plots.raster(str(workdir / "raster.png"), spikes[i, :lengths[i]],
               ref["spikes"][i, :lengths[i]], net.inhibitory,
               f"{Path(ds.paths[i]).name}: input (top), reservoir (bottom), {rb}-bit")
  plots.confusion(str(workdir / "confusion.png"), cm, wf.DIGITS[:classes],
                  f"calcium-rule readout, {rb}-bit, {cfg.folds}-fold CV: "
                  f"{acc_bits[rb]:.3f}")
  summary = {
      "accuracy": acc_bits[rb],
      "accuracy_by_bits": acc_bits,
      "energy_saving_gating": power.saving(energy_bits[rb], base),
      "energy_saving_total": power.saving(energy_bits[str(chosen)], base),
      "sim_steps_per_sec": single,
      "brian2_steps_per_sec": b2_rates.get(b2_best),
      "brian2_target": b2_best,
      "brian2_steps_per_sec_by_target": b2["steps_per_sec"],
      "brian2_spikes_by_target": b2["spikes"],
      "brian2_note": b2["notes"],
      "brian2_python": b2["python"],
      "speedup_vs_brian2": (single / b2_rates[b2_best]) if b2_best else None,
      "speedup_vs_brian2_numpy": (single / b2_rates["numpy"]) if "numpy" in b2_rates else None,
      "sim_steps_per_sec_batched": batched,
      "accuracy_least_squares_by_bits": ls_bits,
      "accuracy_least_squares_spiking": ref["ls_spiking"],
      "chosen_bits_for_total_saving": chosen,
      "energy_saving_total_least_squares": power.saving(energy_bits[chosen_ls], base),
      "chosen_bits_least_squares": chosen_ls,
      "energy_pj_by_bits": energy_bits,
      "energy_pj_ungated_reference": base,
      "gated_ungated_spikes_identical": ref["identical"],
      "firing_rate_by_bits": rates,
      "num_utterances": int(labels.size),
      "rejected_files": [list(x) for x in ds.rejected],
      "confusion_matrix": cm.tolist(),
      "seconds": time.time() - t_start,
      "config": to_dict(cfg),
  }
  if rule.lateral > 0:
    summary["accuracy_without_lateral_by_bits"] = plain_bits
  write_json_atomic(workdir / "summary.json", summary)
  return summary
