"""Results tables in docs/, generated from the results of record.

A doc marks a table with two comments; everything between them is generated:

    <!-- results-table: results/lsm/fsdd.json | accuracy_test | baselines.* -->
    | key | value |
    ...
    <!-- /results-table -->

Each field after the path is a dotted key of the JSON; ``*`` expands over a dict's children
(one row each). Floats print with 4 significant digits. A single field
``rows=PATH: col, col.sub, ...`` makes a wide table instead: one row per element of the list
(or per child of the dict, its key first) at PATH, one column per named key.
``python -m experiments.doc_tables`` rewrites every table in docs/ (and README.md);
``--check`` only reports the ones that differ (``tests/test_doc_tables.py`` runs the check, so
a doc's table always equals its JSON).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(
    r"(<!-- results-table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /results-table -->)", re.S)


class TableError(ValueError):
  """A table's marker names a file or key that does not exist."""


def _fmt(v) -> str:
  if isinstance(v, bool) or v is None:
    return json.dumps(v)
  if isinstance(v, float):
    return f"{v:.4g}"
  if isinstance(v, (list, dict)):
    return "`" + json.dumps(v, separators=(", ", ": ")) + "`"
  return str(v)


def rows(tree, dotted: str, where: str) -> list[tuple[str, object]]:
  """(key, value) pairs at a dotted path; '*' expands over a dict's children."""
  out = [("", tree)]
  for part in dotted.split("."):
    nxt = []
    for key, node in out:
      if not isinstance(node, dict):
        raise TableError(f"{where}: {dotted!r}: {key or 'the root'} is not a mapping")
      if part == "*":
        nxt += [(f"{key}.{k}" if key else k, v) for k, v in node.items()]
      elif part in node:
        nxt.append((f"{key}.{part}" if key else part, node[part]))
      else:
        raise TableError(f"{where}: key {dotted!r} not found (missing {part!r}); "
                         f"present: {sorted(node)}")
    out = nxt
  return out


def wide(tree, spec: str, where: str) -> str:
  """``rows=PATH: col, ...``: one row per list element / dict child at PATH."""
  path, sep, cols = spec.removeprefix("rows=").partition(":")
  cols = [c.strip() for c in cols.split(",") if c.strip()]
  if not sep or not cols:
    raise TableError(f"{where}: write rows=PATH: col, col, ... (got {spec!r})")
  (_, node), = rows(tree, path.strip(), where)
  if isinstance(node, dict):
    items, head = list(node.items()), ["", *cols]
  elif isinstance(node, list):
    items, head = [(None, x) for x in node], cols
  else:
    raise TableError(f"{where}: {path.strip()!r} is neither a list nor a mapping")
  lines = ["| " + " | ".join(f"`{h}`" if h else "" for h in head) + " |",
           "|" + "---|" * len(head)]
  for key, item in items:
    cells = [] if key is None else [f"`{key}`"]
    cells += [_fmt(rows(item, c, where)[0][1]) for c in cols]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def table(spec: str, where: str) -> str:
  """The markdown table a marker's spec stands for."""
  path, *keys = [s.strip() for s in spec.split("|")]
  file = ROOT / path
  if not file.is_file():
    raise TableError(f"{where}: results file {path} does not exist")
  if not keys:
    raise TableError(f"{where}: name at least one key after {path}")
  tree = json.loads(file.read_text())
  if len(keys) == 1 and keys[0].startswith("rows="):
    return wide(tree, keys[0], where)
  lines = ["| key | value |", "|---|---|"]
  for k in keys:
    lines += [f"| `{key}` | {_fmt(v)} |" for key, v in rows(tree, k, where)]
  return "\n".join(lines) + "\n"


def render(text: str, where: str = "doc") -> str:
  """``text`` with every marked table regenerated."""
  return BLOCK.sub(lambda m: m.group(1) + table(m.group("spec"), where) + m.group(4), text)


def docs() -> list[Path]:
  return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "WORKSPACE.md"]


def main(argv: list[str]) -> int:
  unknown = [a for a in argv if a != "--check"]
  if unknown:
    print(f"doc_tables: unknown argument(s) {unknown}; allowed: --check", file=sys.stderr)
    return 2
  check = "--check" in argv
  stale = []
  try:
    for p in docs():
      old = p.read_text()
      new = render(old, str(p.relative_to(ROOT)))
      if new != old:
        stale.append(str(p.relative_to(ROOT)))
        if not check:
          p.write_text(new)
  except TableError as e:
    print(f"doc_tables: {e}", file=sys.stderr)
    return 2
  verb = "differ from their JSON" if check else "rewritten"
  print(f"{len(stale)} doc(s) {verb}: {', '.join(stale) or '-'}")
  return 1 if (check and stale) else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
