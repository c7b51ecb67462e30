"""The reference check: logits of the PyTorch ``transformers`` model on the same tokens.

Optional (``pip install -e '.[hf]'``); :func:`available` says whether torch and transformers
import.
"""

from __future__ import annotations

import numpy as np

INSTALL = "pip install torch==2.13.0 transformers  (or: pip install -e '.[hf]')"


def available() -> bool:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    return False
  return True


def transformers_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
  """Float32 logits [B, T, V] of ``AutoModelForCausalLM.from_pretrained(hf_dir)``."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def jax_logits(model, params, tokens: np.ndarray) -> np.ndarray:
  import jax
  return np.asarray(jax.jit(model.apply)({"params": params}, np.asarray(tokens, np.int32)))


def check_tokens(vocab_size: int, batch: int = 2, length: int = 16, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab_size, (batch, length), dtype=np.int32)
