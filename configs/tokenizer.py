r"""Train a byte-level BPE text tokenizer on a manifest's captions.

  python -m experiments.make_manifest --workdir=/tmp/files
  python -m experiments.train_tokenizer --config=configs/tokenizer.py:text \
      --config.data.manifest=/tmp/files/manifest.jsonl --workdir=/tmp/files/tok

Writes ``tokenizer.json`` (use it with ``--config.data.tokenizer=/tmp/files/tok/tokenizer.json``)
and ``summary.json`` (vocab sizes, compression = UTF-8 bytes per token on held-out text).
Variant ``text``: 1024 learned ids; ``tiny``: 300 (tests).
"""

import ml_collections


def get_config(arg: str = "text") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.data = dict(manifest="", heldout_fraction=0.1)
  c.tokenizer = dict(vocab_size=1024, min_frequency=2)
  if arg == "text":
    pass
  elif arg == "tiny":
    c.tokenizer.update(vocab_size=300)
  else:
    raise ValueError(f"unknown variant {arg!r} of configs/tokenizer.py; choose text or tiny")
  return c
