"""The house rules of WORKSPACE.md ("Where things live"), checked on the source: imports run one
way (no import circle between modules, no cross-package import inside a function), no module
over 500 lines, and the ground floor (omni_jax/common) imports nothing else of omni_jax."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def modules() -> dict[str, Path]:
  out = {}
  for p in sorted((ROOT / "omni_jax").rglob("*.py")):
    name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
    out[name.removesuffix(".__init__")] = p
  return out


def package(mod: str) -> str:
  return mod.split(".")[1] if mod.count(".") else ""


def imports(mods: dict[str, Path]):
  """(importer, imported module, line, inside a function) for every omni_jax import."""
  def resolve(name):
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name

  for mod, path in mods.items():
    tree = ast.parse(path.read_text())
    stack = [(n, False) for n in tree.body]
    while stack:
      node, in_fn = stack.pop()
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{a.name}" for a in node.names]
      for n in names:
        target = resolve(n) if n.startswith("omni_jax") else ""
        if target and target != mod:
          yield mod, target, node.lineno, in_fn
      inner = in_fn or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
      stack += [(c, inner) for c in ast.iter_child_nodes(node)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


@pytest.fixture(scope="module")
def graph():
  mods = modules()
  return mods, list(imports(mods))


def test_no_import_circle_between_modules(graph):
  _, found = graph
  edges: dict[str, set[str]] = {}
  for a, b, _, _ in found:
    edges.setdefault(a, set()).add(b)
  assert cycles(edges) == []


def test_no_cross_package_import_inside_a_function(graph):
  _, found = graph
  bad = [f"{a}:{line} imports {b}" for a, b, line, in_fn in found
         if in_fn and package(a) != package(b)]
  assert bad == []


def test_the_ground_floor_imports_nothing_above_it(graph):
  _, found = graph
  bad = [f"{a} imports {b}" for a, b, _, _ in found
         if package(a) == "common" and package(b) != "common"]
  assert bad == []


def test_side_systems_do_not_import_the_trainer(graph):
  side = {"dpad", "lsm", "query", "visage", "rl", "collectives", "memory"}
  _, found = graph
  bad = [f"{a} imports {b}" for a, b, _, _ in found
         if package(a) in side and package(b) == "train"]
  assert bad == []


def test_no_module_over_500_lines(graph):
  mods, _ = graph
  long = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert long == {}


def test_cycles_finds_a_circle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_heavy_files_the_suite_schedules_first_exist():
  from tests.conftest import HEAVY_FILES_FIRST
  root = Path(__file__).resolve().parent.parent
  missing = [f for f in HEAVY_FILES_FIRST if not (root / f).is_file()]
  assert not missing, f"tests/conftest.py HEAVY_FILES_FIRST names files that are gone: {missing}"
