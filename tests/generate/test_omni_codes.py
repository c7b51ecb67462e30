"""config.model.modalities.<m>.tokenizer: a trained FSQ codec's ids become the image
generate head's classes and targets; generated ids decode through the codec; a missing or
mismatched tokenizer checkpoint is one ConfigError naming the key and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.data.stream import OmniStream
from omni_jax.generate import job
from omni_jax.tokenizers import omni_codes
from omni_jax.tokenizers.codec_io import save_codec
from omni_jax.tokenizers.image_codec import ImageCodec
from omni_jax.train.spec import build_spec


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
  """An (untrained) image codec saved exactly as train_tokenizer saves one."""
  out = tmp_path_factory.mktemp("imtok")
  codec = ImageCodec(levels=(8, 5, 5, 5), width=4)
  shapes = jax.eval_shape(codec.init, jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))
  rng = np.random.default_rng(0)  # random weights of the codec's shapes: no init compile
  params = jax.tree.map(lambda a: np.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                        shapes["params"])
  save_codec(out, "image", dict(levels=[8, 5, 5, 5], width=4), params)
  return str(out)


def test_generate_head_predicts_the_codec_ids(codec_dir):
  cfg = get_config("micro")
  cfg.model.modalities.image.update(tokenizer=codec_dir, codebook_size=0)  # 0: the codec's
  spec = build_spec(cfg.model)
  ms = spec.modality("image")
  assert ms["codebook_size"] == 1000 and ms["gen_codes"] == 16  # 16x16 image -> 4x4 ids
  assert dict((h.name, h.size) for h in spec.heads)["image"] == 1000
  stream = OmniStream(spec, cfg.data)
  assert "image" not in stream.codebooks  # no k-means fit for it
  b = stream.batch(0)
  rows = b["task"] == stream.tasks.index("image:generate")
  assert rows.any()
  sel = b["target_head"][rows] == spec.head_id("image")
  assert (sel.sum(1) == 16).all()  # exactly the codec's ids per image
  t = b["targets"][rows][sel]
  assert t.min() >= 0 and t.max() < 1000
  from omni_jax.modalities import MODALITY_KINDS
  x = MODALITY_KINDS.get("patch").synthesize(ms, np.random.default_rng(0), 3)[None]
  ids = omni_codes.encode(ms, x)
  assert ids.shape == (1, 16) and ids.min() >= 0 and ids.max() < 1000
  grammar = job.output_grammar(spec, "image", 0)
  assert len(grammar) == 18 and grammar.hi[1] - grammar.lo[1] == 1000
  kind, img, _ = omni_codes.decode(ms, ids[0])
  assert kind == "image" and img.shape == (16, 16, 3) and 0 <= img.min() <= img.max() <= 1
  assert job.allowed_outputs(spec)["image"] == "image"


def test_missing_or_mismatched_tokenizer_is_one_clear_error(codec_dir, tmp_path):
  cfg = get_config("micro")
  cfg.model.modalities.image.tokenizer = str(tmp_path / "nothing")
  with pytest.raises(ConfigError, match=r"modalities\.image\.tokenizer.*no trained tokenizer"
                     r".*experiments.train_tokenizer --config=configs/tokenizer.py:image"):
    build_spec(cfg.model)
  cfg = get_config("micro")
  cfg.model.modalities.audio.update(tokenizer=codec_dir, codebook_size=0)
  with pytest.raises(ConfigError, match=r"audio\.tokenizer.*is an image tokenizer.*'patch'"):
    build_spec(cfg.model)
  cfg = get_config("micro")
  cfg.model.modalities.image.tokenizer = codec_dir
  cfg.model.modalities.image.codebook_size = 8
  with pytest.raises(ConfigError, match="codebook_size = 8 contradicts the tokenizer's 1000"):
    build_spec(cfg.model)
