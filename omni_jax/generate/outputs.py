"""Generated code ids back to something a person can look at or listen to.

The omni model's generate heads predict ids of the fixed k-means codebook of each modality
(:mod:`omni_jax.data.vq`; fitted by the training run's data stream and saved with its
checkpoints, read back by :func:`run_codebooks`): for a ``patch`` modality a code is a
patch's mean colour, for a ``frames`` modality with log-mel features it is the log-mel of a
group of 4 frames averaged. Decoding inverts exactly that summary:

* image: each patch is filled with its code's colour (a mosaic of ``size / patch`` cells);
* audio: each code's averaged log-mel is repeated over its 4 frames, the mel power goes back
  to an STFT magnitude by non-negative least squares and Griffin-Lim finds a phase
  (:mod:`omni_jax.tokenizers.griffin_lim`, the same framing as the encoder's log-mel).

:func:`decoder_kind` says which modalities can be an output at all; :func:`contact_sheet`
lays every output of a generate run out in one PNG.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from PIL import Image, ImageDraw, ImageFont

from omni_jax.common.checkpoint import saved_codebooks
from omni_jax.data.pipeline import given_codebooks
from omni_jax.data.stream import make_stream
from omni_jax.tokenizers import griffin_lim as gl

FRAMES_PER_CODE = 4  # frames.code_vectors averages 4 log-mel frames per code


def run_codebooks(spec, data_cfg, workdir: str, step: int) -> dict[str, np.ndarray]:
  """The k-means codebooks checkpoint ``step`` of ``workdir`` was trained with, as saved with
  it (never refitted); a checkpoint without them is refitted from ``data_cfg`` (the
  training run's settings), logged."""
  books = saved_codebooks(workdir, step)
  if books is not None:  # no stream is built: the training data need not be here
    return given_codebooks(dict(spec.modalities), books, complete=False)
  logging.warning("checkpoint step %d of %s holds no k-means codebooks: refitting them from "
                  "config.data (the training run's data, seed and codebook_samples)", step,
                  workdir)
  return make_stream(spec, data_cfg).codebooks


def decoder_kind(ms) -> str | None:
  """'image' or 'audio' when the modality's codes can be turned back into a file, else None."""
  if not ms.get("codebook_size"):
    return None
  if ms.get("tokenizer"):  # a trained FSQ codec (omni_jax/tokenizers/omni_codes.py)
    return "image" if ms["kind"] == "patch" else "audio"
  if ms["kind"] == "patch":
    return "image"
  if ms["kind"] == "frames" and ms.get("features") == "logmel":
    return "audio"
  return None


def codes_to_image(ms, codebook: np.ndarray, codes) -> np.ndarray:
  """Codes [N] of a patch modality -> float image [H, W, C] in [0, 1] (patch mosaic)."""
  h, w = ms["size"]
  p = ms["patch"]
  codes = np.asarray(codes).reshape(h // p, w // p)
  cells = np.asarray(codebook, np.float32)[codes]  # [H/p, W/p, C]
  img = np.repeat(np.repeat(cells, p, axis=0), p, axis=1)
  return np.clip(img, 0.0, 1.0)


def codes_to_log_mel(ms, codebook: np.ndarray, codes) -> np.ndarray:
  """Codes [N] of a log-mel frames modality -> log-mel [frames, n_mels] (first channel)."""
  frames = 1 + (ms["num_samples"] - ms["n_fft"]) // ms["hop"]
  vecs = np.asarray(codebook, np.float32)[np.asarray(codes).reshape(-1)]
  mel = np.repeat(vecs[:, :ms["n_mels"]], FRAMES_PER_CODE, axis=0)[:frames]
  if mel.shape[0] < frames:
    raise ValueError(f"{len(codes)} codes cover {mel.shape[0]} frames; the clip has {frames}")
  return mel


def codes_to_wave(ms, codebook: np.ndarray, codes, seed: int = 0,
                  iterations: int = 64) -> np.ndarray:
  """Codes [N] -> waveform [num_samples] (float32, peak <= 0.99) by Griffin-Lim."""
  return codes_to_waves(ms, codebook, np.asarray(codes)[None], seed, iterations)[0]


def codes_to_waves(ms, codebook: np.ndarray, codes, seed: int = 0,
                   iterations: int = 64) -> np.ndarray:
  """Codes [B, N] -> waveforms [B, num_samples] in one batched Griffin-Lim (each row's
  peak <= 0.99)."""
  mel = np.stack([codes_to_log_mel(ms, codebook, c) for c in np.asarray(codes)])
  mag = gl.mel_to_magnitude(jnp.asarray(mel), sample_rate=ms["sample_rate"],
                            n_fft=ms["n_fft"], n_mels=ms["n_mels"])
  wave = np.asarray(gl.griffin_lim(mag, jax.random.PRNGKey(seed), n_fft=ms["n_fft"],
                                   hop=ms["hop"], num_samples=ms["num_samples"],
                                   iterations=iterations), np.float32)
  peak = np.abs(wave).max(axis=-1, keepdims=True)
  return np.where(peak > 0.99, wave * (0.99 / np.maximum(peak, 1e-12)), wave)


def _tile(kind: str, content, label: str, size: int) -> Image.Image:
  """One contact-sheet cell: the output (image, log-mel picture or text) over its label."""
  font = ImageFont.load_default()
  cell = Image.new("RGB", (size, size + 24), (255, 255, 255))
  draw = ImageDraw.Draw(cell)
  if kind == "image":
    arr = np.asarray(content, np.float32)
    if arr.shape[-1] == 1:
      arr = np.repeat(arr, 3, -1)
    pic = Image.fromarray(np.round(arr[..., :3] * 255).astype(np.uint8))
    cell.paste(pic.resize((size, size), Image.NEAREST), (0, 0))
  elif kind == "audio":  # the log-mel: time left to right, low frequencies at the bottom
    mel = np.asarray(content, np.float32).T[::-1]
    lo, hi = float(mel.min()), float(mel.max())
    grey = np.round(255 * (mel - lo) / max(hi - lo, 1e-6)).astype(np.uint8)
    pic = Image.fromarray(np.stack([grey, grey // 2, 255 - grey], -1))
    cell.paste(pic.resize((size, size), Image.BILINEAR), (0, 0))
  else:  # text, or an error message
    colour = (180, 0, 0) if kind == "error" else (0, 0, 0)
    lines = textwrap.wrap(str(content), width=max(8, size // 7))[: size // 12]
    draw.multiline_text((3, 3), "\n".join(lines), fill=colour, font=font)
  draw.text((3, size + 5), label[: size // 6], fill=(0, 0, 0), font=font)
  return cell


def contact_sheet(items: list[tuple[str, object, str]], path, size: int = 128,
                  columns: int = 4) -> None:
  """Writes one PNG of ``(kind, content, label)`` cells, ``columns`` per row; kind is
  'image' (float [H, W, C]), 'audio' (log-mel [frames, mels]), 'text' or 'error' (str)."""
  if not items:
    raise ValueError("contact_sheet needs at least one item")
  tiles = [_tile(k, c, lab, size) for k, c, lab in items]
  cols = min(columns, len(tiles))
  rows = -(-len(tiles) // cols)
  tw, th = tiles[0].size
  sheet = Image.new("RGB", (cols * (tw + 4) + 4, rows * (th + 4) + 4), (200, 200, 200))
  for i, t in enumerate(tiles):
    sheet.paste(t, (4 + (i % cols) * (tw + 4), 4 + (i // cols) * (th + 4)))
  sheet.save(path)
