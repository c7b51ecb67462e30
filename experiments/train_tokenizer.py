r"""Trains a tokenizer: byte-level BPE on a manifest's text, or an FSQ image / audio codec.

  python -m experiments.train_tokenizer --config=configs/tokenizer.py:text \
      --config.data.manifest=DIR/manifest.jsonl --workdir=DIR/tok
  python -m experiments.train_tokenizer --config=configs/tokenizer.py:image --workdir=DIR/im
  python -m experiments.train_tokenizer --config=configs/tokenizer.py:audio \
      --config.data.manifest=DIR/manifest.jsonl --workdir=DIR/au

The image variant (logic in omni_jax/train/codec_fit.py) resumes from the workdir's orbax
checkpoints and writes summary.json (``recon_psnr_db`` held-out, ``codebook_perplexity``,
``codebook_usage``), recon.png, codec.json + codec_params.msgpack. ``...:audio`` likewise
(``spectral_convergence`` held-out, example WAVs). Without ``data.manifest`` the codecs
train on synthetic renders; with it, on the manifest's files (a held-out split of files).

Text variant:
summary.json: ``vocab_size`` (learned ids + the omni special tokens of the byte tokenizer's
layout for image/audio/video), ``base_vocab_size``, ``compression`` (UTF-8 bytes per token on
the held-out records' text; the byte tokenizer's is 1.0), ``train_texts``, ``heldout_texts``.
"""

from __future__ import annotations

from pathlib import Path

from absl import logging

from experiments import common
from omni_jax.common.config import ConfigError, check_keys, positive_int, require
from omni_jax.common.metrics import write_json_atomic
from omni_jax.data import bpe
from omni_jax.train import codec_fit as codec_train

_CONFIG = common.define_config("configs/tokenizer.py:<variant>")
_WORKDIR = common.define_workdir()
MODALITIES = ("audio", "image", "video")
LEARNED = {"image": codec_train.train_image_tokenizer,
           "audio": codec_train.train_audio_tokenizer}


def main(argv) -> None:
  del argv
  cfg = _CONFIG.value
  kind = cfg.get("kind", "text")
  if kind != "text":
    require(kind in LEARNED, "kind", kind, f"must be text or one of {sorted(LEARNED)}")
    if not _WORKDIR.value:
      raise ConfigError("--workdir is required")
    LEARNED[kind](cfg, _WORKDIR.value)
    return
  check_keys(cfg, ("kind", "data", "tokenizer"), "", required=("data", "tokenizer"))
  check_keys(cfg.data, ("manifest", "heldout_fraction"), "data.", required=("manifest",))
  check_keys(cfg.tokenizer, ("vocab_size", "min_frequency"), "tokenizer.",
             required=("vocab_size",))
  require(bool(cfg.data.manifest) and Path(cfg.data.manifest).is_file(), "data.manifest",
          cfg.data.manifest, "must name an existing JSONL manifest")
  vocab = positive_int(cfg.tokenizer, "vocab_size", "tokenizer.")
  require(vocab >= 256, "tokenizer.vocab_size", vocab, "must be >= 256 (the byte alphabet)")
  if not _WORKDIR.value:
    raise ConfigError("--workdir is required")
  out = Path(_WORKDIR.value)
  out.mkdir(parents=True, exist_ok=True)
  train, held = bpe.manifest_texts(cfg.data.manifest, float(cfg.data.get("heldout_fraction",
                                                                         0.1)))
  hf = bpe.train_bpe(train, vocab, min_frequency=int(cfg.tokenizer.get("min_frequency", 2)))
  hf.save(str(out / "tokenizer.json"))
  tok = bpe.make_tokenizer(str(out / "tokenizer.json"), MODALITIES)
  measured = held or train
  n_bytes = sum(len(t.encode("utf-8")) for t in measured)
  n_tokens = sum(len(tok.encode(t)) for t in measured)
  summary = dict(manifest=str(cfg.data.manifest), vocab_size=tok.vocab_size,
                 base_vocab_size=tok.base_vocab_size, num_specials=tok.num_specials,
                 compression=n_bytes / max(n_tokens, 1),
                 compression_on="heldout" if held else "train (no record held out)",
                 train_texts=len(train), heldout_texts=len(held), heldout_bytes=n_bytes,
                 heldout_tokens=n_tokens)
  write_json_atomic(out / "summary.json", summary)
  logging.info("tokenizer: %d learned ids (+%d specials), %.2f bytes/token on %s -> %s",
               tok.base_vocab_size, tok.num_specials, summary["compression"],
               summary["compression_on"], out / "tokenizer.json")


if __name__ == "__main__":
  common.run(main)
