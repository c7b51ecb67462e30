"""Session fixture: tiny random Hugging Face checkpoints, one per family, built on demand
(skipping, with the install command, when torch / transformers are absent)."""

import pytest

from omni_jax.hf import reference, synthetic


def needs_reference():
  if not reference.available():
    pytest.skip(f"needs torch and transformers: {reference.INSTALL}")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
  cache = {}

  def get(name):
    needs_reference()
    if name not in cache:
      cache[name] = synthetic.build_tiny(name, str(tmp_path_factory.mktemp(name)))
    return cache[name]
  return get
