"""Every results table in docs/ equals the JSON of record it names (experiments.doc_tables)."""

import json

import pytest

from experiments import doc_tables


@pytest.mark.parametrize("path", doc_tables.docs(), ids=lambda p: p.name)
def test_doc_tables_equal_their_json(path):
  text = path.read_text()
  assert doc_tables.render(text, path.name) == text, (
      f"{path.name}: a results table differs from its JSON; run python -m experiments.doc_tables")


def test_render_expands_stars_and_formats(tmp_path, monkeypatch):
  (tmp_path / "r.json").write_text(json.dumps({"a": 0.123456, "b": {"x": 1, "y": None}}))
  monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
  doc = "t\n<!-- results-table: r.json | a | b.* -->\nold\n<!-- /results-table -->\n"
  out = doc_tables.render(doc)
  assert "| `a` | 0.1235 |" in out and "| `b.x` | 1 |" in out and "| `b.y` | null |" in out
  assert "old" not in out and doc_tables.render(out) == out


def test_missing_key_names_what_is_present(tmp_path, monkeypatch):
  (tmp_path / "r.json").write_text(json.dumps({"a": 1}))
  monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
  with pytest.raises(doc_tables.TableError, match=r"'zz' not found.*present: \['a'\]"):
    doc_tables.render("<!-- results-table: r.json | zz -->\n<!-- /results-table -->")


def test_wide_tables_from_a_list_or_a_dict(tmp_path, monkeypatch):
  (tmp_path / "r.json").write_text(json.dumps({
      "runs": [{"name": "a", "t": {"s": 1.5}}, {"name": "b", "t": {"s": 2.0}}],
      "by": {"x": {"n": 1}, "y": {"n": 2}}}))
  monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
  out = doc_tables.render("<!-- results-table: r.json | rows=runs: name, t.s -->\n"
                          "<!-- /results-table -->")
  assert "| `name` | `t.s` |\n|---|---|\n| a | 1.5 |\n| b | 2 |\n" in out
  out = doc_tables.render("<!-- results-table: r.json | rows=by: n -->\n<!-- /results-table -->")
  assert "|  | `n` |\n|---|---|\n| `x` | 1 |\n| `y` | 2 |\n" in out
  with pytest.raises(doc_tables.TableError, match="rows=PATH"):
    doc_tables.render("<!-- results-table: r.json | rows=runs -->\n<!-- /results-table -->")
