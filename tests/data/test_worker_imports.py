"""What a Grain input worker loads: the record-to-document code, not the model.

A worker is a fresh interpreter (Grain spawns it) that unpickles the pipeline's
:class:`~omni_jax.data.documents.DocMaker` and turns records into documents. These tests do
the same in a fresh subprocess and check which modules it holds afterwards: no flax, optax or
``omni_jax.models`` (they cost every worker their resident memory), and no ``scipy.signal``
until a file needs resampling.
"""

from __future__ import annotations

import json
import subprocess
import sys

import cloudpickle
import numpy as np
from PIL import Image

from configs.omni_moe import get_config
from omni_jax.data.documents import DocMaker
from omni_jax.data.records import Item
from omni_jax.data.sequences import TASK_TEXT, understand_task
from omni_jax.train.spec import build_spec
from tests.cli import ROOT, child_env

HEAVY = ("flax", "optax", "omni_jax.models", "omni_jax.train", "scipy.signal")
CHILD = """
import json, pickle, sys
{setup}
loaded = {{m: m in sys.modules for m in {heavy!r}}}
print(json.dumps({{"loaded": loaded, **result}}))
"""


def _child(setup: str) -> dict:
  code = CHILD.format(setup=setup, heavy=HEAVY)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_worker_side_loads_no_model_code():
  got = _child("import omni_jax.data.documents, omni_jax.data.records\nresult = {}")
  assert got["loaded"] == {m: False for m in HEAVY}


def test_an_unpickled_doc_maker_makes_documents_without_the_model(tmp_path):
  cfg = get_config("micro")
  cfg.model.modalities = dict(image=dict(kind="patch", size=(16, 16), channels=3, patch=8,
                                         codebook_size=0, encoder_dim=16, encoder_heads=2))
  spec = build_spec(cfg.model)
  maker = DocMaker(spec, 96, {}, [TASK_TEXT, understand_task("image")])
  Image.fromarray(np.full((20, 12, 3), 200, np.uint8)).save(tmp_path / "a.png")
  items = [Item(0, 0, "m:1", str(tmp_path), json.dumps({"id": "t", "text": "plain text"})),
           Item(0, 1, "m:2", str(tmp_path), json.dumps({"id": "i", "text": "a grey square",
                                                       "image": "a.png"}))]
  want = [maker(it) for it in items]
  path = tmp_path / "maker.pkl"
  path.write_bytes(cloudpickle.dumps((maker, items)))  # as Grain ships it to a worker
  got = _child(f"maker, items = pickle.load(open({str(path)!r}, 'rb'))\n"
               "outs = [maker(it) for it in items]\n"
               "result = {'bad': [o['bad'] for o in outs], "
               "'tokens': [[d.tokens.tolist() for d in o['docs']] for o in outs]}")
  assert got["loaded"] == {m: False for m in HEAVY}
  assert got["bad"] == [None, None]
  assert got["tokens"] == [[d.tokens.tolist() for d in w["docs"]] for w in want]
  assert all(got["tokens"])
