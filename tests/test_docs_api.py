"""Every ```python block of docs/api.md runs as written (8 emulated CPU devices)."""

import pathlib
import re

import pytest

API_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
  """The bodies of the fenced ```python blocks of a markdown text, in order."""
  return BLOCK.findall(text)


def test_block_extraction():
  text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
  assert python_blocks(text) == ["x = 1\n", "y = 2\nz = 3\n"]


BLOCKS = python_blocks(API_MD.read_text())


def test_api_md_has_the_four_examples():
  assert len(BLOCKS) == 4
  for name in ("OmniModel", "ring_all_reduce", "jax.vmap(train)", "plan_harmony"):
    assert sum(name in b for b in BLOCKS) == 1, name


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_api_md_example_runs(index):
  code = compile(BLOCKS[index], f"docs/api.md[python block {index + 1}]", "exec")
  exec(code, {"__name__": f"docs_api_{index}"})
