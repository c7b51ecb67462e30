"""FSQ codecs on a manifest's files: train_tokenizer fits them on the files (held-out split by
file), the manifest pipeline's generate targets are the codec's ids of each decoded file, a
train_omni run keeps its codec in its workdir and generation decodes with that copy after the
tokenizer workdir is gone; bad input is one clear error."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from PIL import Image

from configs.omni_moe import get_config
from configs.tokenizer import get_config as tokenizer_config
from omni_jax.common.config import ConfigError
from omni_jax.data.decode import decode_image, decode_wav
from omni_jax.data.encode import write_wav
from omni_jax.data.pipeline import DataError, PipelineStream
from omni_jax.data.records import open_dataset
from omni_jax.data.stream import make_stream
from omni_jax.tokenizers import omni_codes
from omni_jax.tokenizers.codec_io import save_codec
from omni_jax.tokenizers.codec_store import pin_codecs, saved_dir
from omni_jax.tokenizers.image_codec import ImageCodec
from omni_jax.train import codec_files, codec_fit
from omni_jax.train.spec import build_spec


def _manifest(tmp_path, n=10, audio=True, broken=True):
  """n records: a smooth 20x24 PNG (colour ramps, unlike a flat mean) and a tone WAV each."""
  lines = []
  y, x = np.mgrid[0:20, 0:24]
  for i in range(n):
    rng = np.random.default_rng(i)
    a, b = rng.uniform(0, 1, 3), rng.uniform(-1, 1, 3)
    img = np.clip(a + b * (np.cos(x / (3 + i % 4))[..., None] * y[..., None] / 19), 0, 1)
    Image.fromarray((img * 255).astype(np.uint8)).save(tmp_path / f"im{i}.png")
    rec = {"id": i, "text": f"ramp {i}", "image": f"im{i}.png"}
    if audio:
      write_wav(tmp_path / f"a{i}.wav", 0.5 * np.sin(np.arange(3000) * 0.05 * (i + 1)), 11025)
      rec["audio"] = f"a{i}.wav"
    lines.append(json.dumps(rec))
  if broken:
    (tmp_path / "bad.png").write_bytes(b"not a png")
    lines.append(json.dumps({"id": "bad", "text": "broken", "image": "bad.png"}))
  (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
  return tmp_path / "m.jsonl"


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
  """An (untrained) image codec saved as train_tokenizer saves one."""
  out = tmp_path_factory.mktemp("imtok")
  codec = ImageCodec(levels=(8, 5, 5, 5), width=4)
  shapes = jax.eval_shape(codec.init, jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: np.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                        shapes["params"])
  save_codec(out, "image", dict(levels=[8, 5, 5, 5], width=4), params)
  return out


def test_manifest_files_are_the_pipelines_decodes_split_by_file(tmp_path):
  m = _manifest(tmp_path)
  ms = codec_files.image_modality("image", (16, 16))
  train, held, info = codec_files.manifest_files(str(m), ms, 0.3)
  assert info["files_skipped"] == 1 and info["train_files"] + info["heldout_files"] == 10
  assert info["train_files"] >= 1 and info["heldout_files"] >= 1
  want = np.stack([decode_image(tmp_path / f"im{i}.png", (16, 16), 3) for i in range(10)])
  got = np.concatenate([train, held])
  # every decoded file is one of the pipeline's decodes, each used once
  match = [int(np.flatnonzero(np.abs(want - g).max(axis=(1, 2, 3)) == 0)[0]) for g in got]
  assert sorted(match) == list(range(10))
  au = codec_files.audio_modality("audio", 8000, 1024)
  train_a, held_a, _ = codec_files.manifest_files(str(m), au, 0.3)
  want_a = [decode_wav(tmp_path / f"a{i}.wav", sample_rate=8000, num_samples=1024,
                       offset=0.5) for i in range(10)]
  assert all(any(np.array_equal(g, w) for w in want_a) for g in np.concatenate([train_a,
                                                                                held_a]))


def test_image_codec_trained_on_files_improves_on_held_out_files(tmp_path):
  cfg = tokenizer_config("image_tiny")
  cfg.data.update(manifest=str(_manifest(tmp_path, audio=False)), size=(16, 16), crop=16,
                  heldout_fraction=0.3, batch_size=8)
  cfg.train.update(steps=60, checkpoint_every=60, log_every=20)
  cfg.optim.update(lr=1e-2, warmup_steps=5)
  s = codec_fit.train_image_tokenizer(cfg, str(tmp_path / "tok"))
  assert s["train_files"] + s["heldout_files"] == 10 and s["files_skipped"] == 1
  assert s["codes_per_image"] == 16 and s["image_size"] == [16, 16]
  assert np.isfinite(s["baseline_mean_colour_psnr_db"])
  first = json.loads((tmp_path / "tok" / "metrics.jsonl").read_text().splitlines()[0])
  assert first["step"] == 0  # the untrained codec on the held-out files
  # held-out files, never trained on: recon improves by training on the other files
  assert s["recon_psnr_db"] > first["eval/recon_psnr_db"] + 0.5


@pytest.mark.slow  # ~13 s on a shared 2-core machine (compile-bound)
def test_audio_codec_trains_on_files(tmp_path):
  cfg = tokenizer_config("audio_tiny")
  cfg.data.update(manifest=str(_manifest(tmp_path)), num_samples=1024, heldout_fraction=0.3)
  s = codec_fit.train_audio_tokenizer(cfg, str(tmp_path / "tok"))
  assert s["train_files"] + s["heldout_files"] == 10 and s["num_samples"] == 1024
  assert s["clip_samples"] == 8128 and np.isfinite(s["logmel_snr_db"])
  assert (tmp_path / "tok" / "codec.json").is_file()


def test_manifest_without_files_of_the_modality_is_one_data_error(tmp_path):
  cfg = tokenizer_config("audio_tiny")
  cfg.data.update(manifest=str(_manifest(tmp_path, audio=False)))
  with pytest.raises(DataError,
                     match=r"0 decodable 'audio' file\(s\).*at least two.*data.source_key"):
    codec_fit.train_audio_tokenizer(cfg, str(tmp_path / "tok"))


def _manifest_config(manifest, codec):
  cfg = get_config("micro")
  cfg.model.modalities = {"image": cfg.model.modalities["image"]}
  cfg.model.modalities.image.update(tokenizer=str(codec), codebook_size=0)
  cfg.data.update(source="manifest", manifest=str(manifest), pack_window=8, prefetch=1,
                  max_bad_fraction=0.2)
  cfg.train.update(steps=2, checkpoint_every=2)
  return cfg


def test_pipeline_generate_targets_are_the_codecs_ids_of_the_decoded_file(tmp_path, codec_dir):
  cfg = _manifest_config(_manifest(tmp_path, audio=False, broken=False), codec_dir)
  spec = build_spec(cfg.model)
  stream = make_stream(spec, cfg.data)
  assert isinstance(stream, PipelineStream)
  assert stream.codebooks == {}  # no k-means fit for a modality with a codec
  data = open_dataset(cfg.data.manifest, 0.0)
  ms = spec.modality("image")
  for i in range(3):
    out = stream.maker(data.item(i))
    gen = [d for d in out["docs"] if d.task == stream.tasks.index("image:generate")]
    assert len(gen) == 1
    d = gen[0]
    got = d.targets[d.target_head == spec.head_id("image")]
    rec = json.loads(data.item(i).payload)
    x = decode_image(tmp_path / rec["image"], (16, 16), 3)
    np.testing.assert_array_equal(got, omni_codes.encode(ms, x[None])[0])


@pytest.mark.slow  # ~65 s on a shared 2-core machine (train_omni + generate compiles)
def test_train_on_files_then_generate_after_the_tokenizer_is_deleted(tmp_path, codec_dir):
  from omni_jax.generate import job
  from omni_jax.train.omni import train_omni
  tok = tmp_path / "tok"
  shutil.copytree(codec_dir, tok)
  cfg = _manifest_config(_manifest(tmp_path, audio=False), tok)
  wd = tmp_path / "run"
  summary = train_omni(cfg, str(wd))
  assert summary["steps"] == 2
  for f in ("codec.json", "codec_params.msgpack"):
    assert (saved_dir(str(wd), "image") / f).read_bytes() == (tok / f).read_bytes()
  shutil.rmtree(tok)
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"text": "ramp 1", "output": "image"}) + "\n")
  s = job.run_generate(cfg, str(wd), str(prompts), str(tmp_path / "out"), temperature=0.0)
  assert not s["errors"]
  img = np.asarray(Image.open(tmp_path / "out" / "line1-image.png"))
  assert img.shape == (16, 16, 3)
  # the PNG is the run's own copy of the codec decoding the generated ids
  ms = build_spec(pin_codecs(cfg, str(wd), copy=False).model).modality("image")
  _, want, _ = omni_codes.decode(ms, s["outputs"][0]["codes"])
  np.testing.assert_array_equal(img, np.round(want * 255).astype(np.uint8))


def test_resumed_run_with_another_codec_is_refused(tmp_path, codec_dir):
  tok = tmp_path / "tok"
  shutil.copytree(codec_dir, tok)
  cfg = ml_collections.ConfigDict({"model": {"modalities": {"image": {"tokenizer": str(tok)}}}})
  pinned = pin_codecs(cfg, str(tmp_path / "run"), copy=True)
  assert pinned.model.modalities.image.tokenizer == str(saved_dir(str(tmp_path / "run"),
                                                                  "image"))
  assert cfg.model.modalities.image.tokenizer == str(tok)  # the caller's config untouched
  blob = tok / "codec_params.msgpack"
  blob.write_bytes(blob.read_bytes()[:-1] + b"\x00")
  with pytest.raises(ConfigError, match=r"image.tokenizer.*another codec than the one this run"):
    pin_codecs(cfg, str(tmp_path / "run"), copy=True)
  again = pin_codecs(cfg, str(tmp_path / "run"), copy=False)  # generate: the run's own copy
  assert again.model.modalities.image.tokenizer == pinned.model.modalities.image.tokenizer


def test_tokenizer_of_the_wrong_kind_is_one_config_error(tmp_path, codec_dir):
  cfg = _manifest_config(_manifest(tmp_path, audio=False, broken=False), codec_dir)
  cfg.model.modalities = {"audio": get_config("micro").model.modalities["audio"]}
  cfg.model.modalities.audio.update(tokenizer=str(codec_dir), codebook_size=0)
  with pytest.raises(ConfigError, match=r"audio\.tokenizer.*is an image tokenizer.*'patch'"):
    build_spec(cfg.model)
