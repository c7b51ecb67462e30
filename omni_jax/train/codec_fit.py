"""Training the learned tokenizers with the stack's loop (:func:`omni_jax.train.loop.fit`).

:func:`train_image_tokenizer` fits :class:`~omni_jax.tokenizers.image_codec.ImageCodec` to
random crops of real pictures (:mod:`omni_jax.examples.image_data`), or of a manifest's image
files (``data.manifest``, :mod:`omni_jax.train.codec_files`), with a pixel MSE loss,
resumable from orbax checkpoints in ``<workdir>/checkpoints``; it then measures on the
held-out crops (or files) ``recon_psnr_db``, ``codebook_perplexity`` and ``codebook_usage``, writes
``summary.json``, ``recon.png`` (held-out originals above their reconstructions) and the codec
itself (``codec.json`` + ``codec_params.msgpack``, read back by
:func:`omni_jax.tokenizers.codec_io.load_codec`).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from PIL import Image

from omni_jax.common.config import check_keys, positive_int, require
from omni_jax.common.metrics import atomic_path, write_json_atomic
from omni_jax.data.encode import write_wav
from omni_jax.examples import audio_data, image_data
from omni_jax.tokenizers import audio_codec, fsq, griffin_lim
from omni_jax.tokenizers.audio_codec import AudioCodec
from omni_jax.tokenizers.codec_io import save_codec
from omni_jax.tokenizers.image_codec import DOWNSAMPLE, ImageCodec, psnr_db
from omni_jax.train import codec_files
from omni_jax.train.loop import LoopConfig, fit
from omni_jax.train.optim import make_optimizer

IMAGE_DATA_KEYS = ("crop", "batch_size", "photo_share", "heldout")
# data.manifest set: the codec trains on that manifest's files instead of synthetic renders.
IMAGE_FILE_KEYS = ("manifest", "source_key", "size", "heldout_fraction")


def _single_device():
  dev = jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(dev)
  return (lambda abstract: jax.tree.map(lambda _: sharding, abstract),
          lambda batch: jax.device_put(batch, dev))


def _grid_png(rows: list[np.ndarray], path: Path) -> None:
  """Writes rows of [N, H, W, 3] images in [0, 1] as one PNG (2-pixel gutters)."""
  n, h, w, _ = rows[0].shape
  g = 2
  canvas = np.ones((len(rows) * (h + g) + g, n * (w + g) + g, 3), np.float32)
  for r, imgs in enumerate(rows):
    for i in range(n):
      y, x = g + r * (h + g), g + i * (w + g)
      canvas[y:y + h, x:x + w] = np.clip(imgs[i], 0, 1)
  big = Image.fromarray(np.round(canvas * 255).astype(np.uint8)).resize(
      (canvas.shape[1] * 3, canvas.shape[0] * 3), Image.Resampling.NEAREST)
  with atomic_path(path) as tmp:
    big.save(tmp, format="PNG")


def train_image_tokenizer(cfg, workdir: str) -> dict:
  """Trains the FSQ image codec of ``cfg`` (see configs/tokenizer.py:image); returns the
  summary it writes to ``<workdir>/summary.json``."""
  check_keys(cfg, ("kind", "codec", "data", "optim", "train"), "",
             required=("kind", "codec", "data", "optim", "train"))
  check_keys(cfg.codec, ("levels", "width"), "codec.", required=("levels", "width"))
  check_keys(cfg.data, IMAGE_DATA_KEYS + IMAGE_FILE_KEYS, "data.", required=IMAGE_DATA_KEYS)
  levels = fsq.check_levels(cfg.codec.levels)
  width = positive_int(cfg.codec, "width", "codec.")
  crop = positive_int(cfg.data, "crop", "data.")
  manifest = str(cfg.data.get("manifest", "") or "")
  if manifest:
    im_size = tuple(cfg.data.get("size", (crop, crop)))
    require(len(im_size) == 2 and all(isinstance(s, int) and s > 0 and s % DOWNSAMPLE == 0
                                      for s in im_size), "data.size", im_size,
            f"must be (height, width), multiples of {DOWNSAMPLE} (the image modality's size)")
    require(crop % DOWNSAMPLE == 0 and crop <= min(im_size), "data.crop", crop,
            f"must be a multiple of {DOWNSAMPLE} and at most data.size = {im_size}")
  else:
    require(crop % DOWNSAMPLE == 0 and crop <= image_data.DIGIT_SIDE, "data.crop", crop,
            f"must be a multiple of {DOWNSAMPLE} and at most {image_data.DIGIT_SIDE}")
  batch_size = positive_int(cfg.data, "batch_size", "data.")
  n_held = positive_int(cfg.data, "heldout", "data.")
  share = cfg.data.photo_share
  require(isinstance(share, int | float) and 0 <= share <= 1, "data.photo_share", share,
          "must be in [0, 1]")
  loop = LoopConfig.from_config(cfg.train)
  out = Path(workdir)
  out.mkdir(parents=True, exist_ok=True)

  codec = ImageCodec(levels=levels, width=width)
  sample = jnp.zeros((1, crop, crop, 3), jnp.float32)

  def init_params(key):
    return codec.init(key, sample)["params"]

  def loss_fn(params, batch):
    recon, _ = codec.apply({"params": params}, batch["images"])
    mse = jnp.mean((recon - batch["images"]) ** 2)
    return mse, {"loss": mse, "psnr_db": -10.0 * jnp.log10(mse + 1e-12)}

  if manifest:
    ms = codec_files.image_modality(str(cfg.data.get("source_key", "image")), im_size)
    train_x, held, files = codec_files.manifest_files(
        manifest, ms, cfg.data.get("heldout_fraction", 0.2))
    get_batch = lambda s: {"images": codec_files.random_crops(train_x, loop.seed, s,
                                                              batch_size, crop)}
  else:
    held = image_data.heldout_crops(n_held, crop, photo_share=float(share))
    get_batch = lambda s: {"images": image_data.train_batch(loop.seed, s, batch_size, crop,
                                                            float(share))}
  apply = jax.jit(lambda p, x: codec.apply({"params": p}, x))

  def evaluate(params):
    recon, ids = [], []
    for i in range(0, len(held), 64):
      r, c = apply(params, held[i:i + 64])
      recon.append(np.asarray(r))
      ids.append(np.asarray(c))
    return np.concatenate(recon), np.concatenate(ids)

  def eval_fn(params, step):
    recon, _ = evaluate(params)
    return {"recon_psnr_db": psnr_db(held, np.clip(recon, 0, 1))}

  param_sharding, put = _single_device()
  result = fit(workdir=str(out), loop=loop, init_params=init_params, loss_fn=loss_fn,
               tx=make_optimizer(cfg.optim, loop.steps),
               get_batch=get_batch, put_batch=put, param_sharding=param_sharding,
               eval_fn=eval_fn,
               tokens_per_step=batch_size * (crop // DOWNSAMPLE) ** 2)
  params = result.state.params
  recon, ids = evaluate(params)
  recon = np.clip(recon, 0, 1)
  size = fsq.codebook_size(levels)
  if manifest:
    data = dict(image_size=list(im_size), crop=crop, **files,
                stats_on="held-out files of the manifest (never trained on)")
  else:
    data = dict(image_size=crop, heldout_crops=len(held),
                heldout_pictures=len(image_data.pictures("heldout")),
                train_pictures=len(image_data.pictures("train")),
                stats_on="held-out crops (pictures never trained on)")
  mean_colour = np.broadcast_to(held.mean(axis=(1, 2), keepdims=True), held.shape)
  summary = dict(
      kind="image", recon_psnr_db=psnr_db(held, recon),
      baseline_mean_colour_psnr_db=psnr_db(held, mean_colour), **fsq.code_stats(ids, size),
      codebook_size=size, levels=list(levels), codes_per_image=int(ids[0].size), **data,
      steps=int(jax.device_get(result.state.step)),
      train_psnr_db_last=float(result.records[-1].get("psnr_db", np.nan))
      if result.records else None,
      mean_step_time_s=result.mean_step_time, resumed_from=result.resumed_from)
  save_codec(out, "image", dict(levels=list(levels), width=width), params)
  _grid_png([held[:12], recon[:12]], out / "recon.png")
  write_json_atomic(out / "summary.json", summary)
  logging.info("image tokenizer: held-out PSNR %.2f dB, perplexity %.1f of %d codes, "
               "usage %.3f -> %s", summary["recon_psnr_db"], summary["codebook_perplexity"],
               size, summary["codebook_usage"], out)
  return summary


AUDIO_DATA_KEYS = ("batch_size", "heldout")
AUDIO_FILE_KEYS = ("manifest", "source_key", "num_samples", "heldout_fraction")
AUDIO_CODEC_KEYS = ("levels", "width", "sample_rate", "n_fft", "hop", "n_mels", "clip_samples")


def train_audio_tokenizer(cfg, workdir: str) -> dict:
  """Trains the FSQ log-mel codec of ``cfg`` (configs/tokenizer.py:audio) on tones, voice-like
  signals and espeak-ng speech; measures on held-out clips ``spectral_convergence`` of the
  Griffin-Lim waveform decoded from the codes (and, for reference, of Griffin-Lim from the
  clip's own log-mel: the inversion's floor), ``logmel_snr_db`` of the codec's log-mel,
  ``codebook_perplexity``, ``codebook_usage``; writes summary.json, example WAVs
  (``heldout-<i>-{orig,recon}.wav``) and the codec."""

  check_keys(cfg, ("kind", "codec", "data", "optim", "train"), "",
             required=("kind", "codec", "data", "optim", "train"))
  check_keys(cfg.codec, AUDIO_CODEC_KEYS, "codec.", required=AUDIO_CODEC_KEYS)
  check_keys(cfg.data, AUDIO_DATA_KEYS + AUDIO_FILE_KEYS, "data.", required=AUDIO_DATA_KEYS)
  levels = fsq.check_levels(cfg.codec.levels)
  ints = {k: positive_int(cfg.codec, k, "codec.") for k in AUDIO_CODEC_KEYS[1:]}
  codec = AudioCodec(levels=levels, **ints)
  batch_size = positive_int(cfg.data, "batch_size", "data.")
  n_held = positive_int(cfg.data, "heldout", "data.")
  loop = LoopConfig.from_config(cfg.train)
  out = Path(workdir)
  out.mkdir(parents=True, exist_ok=True)
  rate, n = codec.sample_rate, codec.clip_samples

  def loss_fn(params, batch):
    recon, target, _ = codec.apply({"params": params}, batch["waves"])
    mse = jnp.mean(((recon - target) / audio_codec.LOG_MEL_SCALE) ** 2)
    return mse, {"loss": mse}

  manifest = str(cfg.data.get("manifest", "") or "")
  if manifest:  # decoded at the audio modality's length, then fitted to the codec's clip
    ms = codec_files.audio_modality(str(cfg.data.get("source_key", "audio")), rate,
                                    positive_int(cfg.data, "num_samples", "data.")
                                    if cfg.data.get("num_samples") else n)
    train_x, held, files = codec_files.manifest_files(
        manifest, ms, cfg.data.get("heldout_fraction", 0.2))
    train_x, held = codec_files.fit_length(train_x, n), codec_files.fit_length(held, n)
    get_batch = lambda s: {"waves": codec_files.random_clips(train_x, loop.seed, s, batch_size)}
    data = dict(num_samples=ms["num_samples"], **files,
                stats_on="held-out files of the manifest (never trained on)")
  else:
    held = audio_data.heldout_clips(n_held, n, rate)
    get_batch = lambda s: {"waves": audio_data.train_batch(loop.seed, s, batch_size, n, rate)}
    data = dict(heldout_clips=len(held), espeak_speech=bool(audio_data.spoken("train", rate)),
                stats_on="held-out clips (own seed stream; unseen sentences and voice)")
  apply = jax.jit(lambda p, x: codec.apply({"params": p}, x))

  def evaluate(params):
    recon, target, ids = apply(params, held)
    err = jnp.sum((recon - target) ** 2)
    sig = jnp.sum((target - target.mean()) ** 2)
    return recon, target, ids, float(10 * jnp.log10(sig / jnp.maximum(err, 1e-12)))

  param_sharding, put = _single_device()
  result = fit(workdir=str(out), loop=loop, init_params=codec.init_params, loss_fn=loss_fn,
               tx=make_optimizer(cfg.optim, loop.steps),
               get_batch=get_batch, put_batch=put, param_sharding=param_sharding,
               eval_fn=lambda p, s: {"logmel_snr_db": evaluate(p)[3]},
               tokens_per_step=batch_size * codec.codes_per_clip)
  params = result.state.params
  recon, target, ids, mel_snr = evaluate(params)
  wave = np.asarray(audio_codec.log_mel_to_wave(codec, recon))
  floor = np.asarray(audio_codec.log_mel_to_wave(codec, target))
  sc = dict(n_fft=codec.n_fft, hop=codec.hop)
  size = fsq.codebook_size(levels)
  summary = dict(
      kind="audio", spectral_convergence=griffin_lim.spectral_convergence(held, wave, **sc),
      spectral_convergence_griffin_lim_floor=griffin_lim.spectral_convergence(held, floor, **sc),
      logmel_snr_db=mel_snr, **fsq.code_stats(np.asarray(ids), size), codebook_size=size,
      levels=list(levels), codes_per_clip=codec.codes_per_clip,
      codes_per_second=codec.codes_per_clip * rate / n, sample_rate=rate, clip_samples=n,
      **data, steps=int(jax.device_get(result.state.step)),
      mean_step_time_s=result.mean_step_time, resumed_from=result.resumed_from)
  save_codec(out, "audio", dict(levels=list(levels), **ints), params)
  for i in range(min(3, len(held))):
    write_wav(out / f"heldout-{i}-orig.wav", held[i], rate)
    write_wav(out / f"heldout-{i}-recon.wav", wave[i], rate)
  write_json_atomic(out / "summary.json", summary)
  logging.info("audio tokenizer: held-out spectral convergence %.3f (Griffin-Lim floor %.3f), "
               "log-mel SNR %.2f dB, perplexity %.1f of %d codes, usage %.3f -> %s",
               summary["spectral_convergence"], summary["spectral_convergence_griffin_lim_floor"],
               mel_snr, summary["codebook_perplexity"], size, summary["codebook_usage"], out)
  return summary
