r"""Tokenizers trained by the stack: BPE text, FSQ image and audio codecs.

  python -m experiments.make_manifest --workdir=/tmp/files
  python -m experiments.train_tokenizer --config=configs/tokenizer.py:text \
      --config.data.manifest=/tmp/files/manifest.jsonl --workdir=/tmp/files/tok
  python -m experiments.train_tokenizer --config=configs/tokenizer.py:image --workdir=/tmp/imtok

``text`` writes ``tokenizer.json`` (use it with
``--config.data.tokenizer=/tmp/files/tok/tokenizer.json``) and ``summary.json`` (vocab sizes,
compression = UTF-8 bytes per token on held-out text); ``tiny``: 300 ids (tests).
``image``: a convolutional autoencoder with an FSQ bottleneck (levels 8,5,5,5 = 1000 codes;
a 32x32 crop becomes 8x8 codes) on scikit-image photographs and scikit-learn digits;
summary.json has ``recon_psnr_db`` (held-out), ``codebook_perplexity``, ``codebook_usage``;
``image_tiny``: the same in seconds (tests). With ``--config.data.manifest=M.jsonl`` the
codec trains on the manifest's image files instead, decoded as the omni pipeline decodes them
for an image modality of ``data.size``, files split by path hash into train / held out
(``data.heldout_fraction``); summary.json adds ``train_files``, ``heldout_files``,
``files_skipped`` and the trivial baseline ``baseline_mean_colour_psnr_db``.
``audio``: 1-D convolutions over 64-band log-mel frames (8 kHz, hop 64) with the same FSQ
bottleneck (a 1.0 s clip = 62 codes), waveform by Griffin-Lim; trained on tones, voice-like
signals and espeak-ng speech; summary.json has ``spectral_convergence`` (held-out),
``codebook_perplexity``, ``codebook_usage``; ``audio_tiny`` for tests. ``data.manifest``
likewise trains it on a manifest's audio files (``data.num_samples``: the audio modality's).
"""

import ml_collections


def _train(steps, log_every):
  return dict(steps=steps, seed=0, log_every=log_every, eval_every=0, eval_batches=1,
              checkpoint_every=max(steps // 2, 1), keep_checkpoints=2, peak_flops=1.0)


def _optim(lr, steps):
  return dict(lr=lr, warmup_steps=min(50, steps // 10), min_lr_ratio=0.1, weight_decay=0.0,
              b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0)


def _image(steps, width, batch, heldout, log_every):
  c = ml_collections.ConfigDict()
  c.kind = "image"
  c.codec = dict(levels=(8, 5, 5, 5), width=width)
  # manifest '': synthetic renders; else that manifest's files under source_key, decoded to
  # size (the image modality's), trained on crop x crop windows, heldout_fraction held out.
  c.data = dict(crop=32, batch_size=batch, photo_share=0.75, heldout=heldout, manifest="",
                source_key="image", size=(32, 32), heldout_fraction=0.2)
  c.optim = _optim(2e-3, steps)
  c.train = _train(steps, log_every)
  return c


def _audio(steps, width, batch, heldout, log_every):
  c = ml_collections.ConfigDict()
  c.kind = "audio"
  c.codec = dict(levels=(8, 5, 5, 5), width=width, sample_rate=8000, n_fft=256, hop=64,
                 n_mels=64, clip_samples=8128)
  # manifest: its files under source_key, decoded at num_samples (the audio modality's; 0 =
  # the codec's clip) and cut / zero-padded to clip_samples as the omni model's targets are.
  c.data = dict(batch_size=batch, heldout=heldout, manifest="", source_key="audio",
                num_samples=0, heldout_fraction=0.2)
  c.optim = _optim(2e-3, steps)
  c.train = _train(steps, log_every)
  return c


def get_config(arg: str = "text") -> ml_collections.ConfigDict:
  if arg == "audio":
    return _audio(steps=400, width=64, batch=16, heldout=32, log_every=50)
  if arg == "audio_tiny":
    return _audio(steps=4, width=8, batch=2, heldout=3, log_every=2)
  if arg == "image":
    return _image(steps=500, width=32, batch=32, heldout=256, log_every=50)
  if arg == "image_tiny":
    return _image(steps=6, width=8, batch=4, heldout=8, log_every=2)
  c = ml_collections.ConfigDict()
  c.kind = "text"
  c.data = dict(manifest="", heldout_fraction=0.1)
  c.tokenizer = dict(vocab_size=1024, min_frequency=2)
  if arg == "text":
    pass
  elif arg == "tiny":
    c.tokenizer.update(vocab_size=300)
  else:
    raise ValueError(f"unknown variant {arg!r} of configs/tokenizer.py; choose text, tiny, "
                     "image, image_tiny, audio or audio_tiny")
  return c
