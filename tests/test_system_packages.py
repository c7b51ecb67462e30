"""Missing system packages: skip naming the package and its install command; fail under CI."""

import os
import stat
import subprocess
import sys

import pytest

from omni_jax.dpad import documents
from tests.system_packages import DEJAVU_FONTS, ESPEAK_NG, in_ci, require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_espeak(monkeypatch, tmp_path):
  empty = tmp_path / "empty_bin"
  empty.mkdir()
  monkeypatch.setenv("PATH", str(empty))


@pytest.mark.parametrize("value,expected", [("true", True), ("TRUE", True), ("1", True),
                                            ("false", False), ("", False), ("0", False)])
def test_in_ci_reads_the_ci_variable(monkeypatch, value, expected):
  monkeypatch.setenv("CI", value)
  assert in_ci() is expected
  monkeypatch.delenv("CI")
  assert in_ci() is False


def test_missing_espeak_skips_with_package_and_command(monkeypatch, tmp_path):
  _no_espeak(monkeypatch, tmp_path)
  monkeypatch.delenv("CI", raising=False)
  with pytest.raises(pytest.skip.Exception) as e:
    require(ESPEAK_NG)
  assert str(e.value) == ("needs espeak-ng (no espeak-ng (or espeak) on PATH): install it with "
                          "`apt-get install espeak-ng`")


def test_missing_espeak_fails_under_ci(monkeypatch, tmp_path):
  _no_espeak(monkeypatch, tmp_path)
  monkeypatch.setenv("CI", "true")
  with pytest.raises(pytest.fail.Exception, match=r"needs espeak-ng .*`apt-get install "
                     r"espeak-ng`\. CI=true and \.ci/run installs espeak-ng"):
    require(ESPEAK_NG)


@pytest.mark.parametrize("ci", ["true", ""])
def test_present_espeak_passes_with_and_without_ci(monkeypatch, tmp_path, ci):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  exe = bin_dir / "espeak-ng"
  exe.write_text("#!/bin/sh\n")
  exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
  monkeypatch.setenv("PATH", str(bin_dir))
  monkeypatch.setenv("CI", ci)
  assert require(ESPEAK_NG) is None


def test_missing_fonts_skip_naming_the_absent_file(monkeypatch, tmp_path):
  for f in documents.FONT_FILES[1:]:              # all but DejaVuSans.ttf
    (tmp_path / f).write_bytes(b"")
  monkeypatch.setattr(documents, "FONT_DIR", str(tmp_path))
  monkeypatch.delenv("CI", raising=False)
  with pytest.raises(pytest.skip.Exception) as e:
    require(DEJAVU_FONTS)
  assert str(e.value) == (f"needs the DejaVu fonts (DejaVuSans.ttf not in {tmp_path}): install "
                          "it with `apt-get install fonts-dejavu-core`")


def test_missing_fonts_fail_under_ci(monkeypatch, tmp_path):
  monkeypatch.setattr(documents, "FONT_DIR", str(tmp_path / "nowhere"))
  monkeypatch.setenv("CI", "true")
  with pytest.raises(pytest.fail.Exception, match=r"`apt-get install fonts-dejavu-core`\. "
                     r"CI=true and \.ci/run installs fonts-dejavu-core"):
    require(DEJAVU_FONTS)


def test_present_fonts_pass(monkeypatch, tmp_path):
  for f in documents.FONT_FILES:
    (tmp_path / f).write_bytes(b"")
  monkeypatch.setattr(documents, "FONT_DIR", str(tmp_path))
  monkeypatch.setenv("CI", "true")
  assert require(DEJAVU_FONTS) is None


def test_fixture_skips_a_test_end_to_end(tmp_path):
  """A test using such a fixture, in a fresh pytest run without espeak-ng on PATH: reported
  as skipped with the install command; under CI as an error naming the package."""
  (tmp_path / "conftest.py").write_text(
      "import pytest\n"
      "from tests.system_packages import ESPEAK_NG, require\n"
      "@pytest.fixture\n"
      "def needs_espeak_ng():\n"
      "  require(ESPEAK_NG)\n")
  (tmp_path / "test_speaks.py").write_text(
      "import pytest\n"
      "@pytest.mark.usefixtures('needs_espeak_ng')\n"
      "def test_speaks():\n"
      "  assert False, 'must not run'\n")
  empty = tmp_path / "empty_bin"
  empty.mkdir()
  env = dict(os.environ, PATH=str(empty), PYTHONPATH=ROOT, CI="")
  cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs",
         "-o", "addopts=", "test_speaks.py"]
  res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0 and "1 skipped" in res.stdout, res.stdout[-2000:]
  assert "needs espeak-ng (no espeak-ng (or espeak) on PATH): install it with `apt-get " \
         "install espeak-ng`" in res.stdout
  res = subprocess.run(cmd, cwd=tmp_path, env=dict(env, CI="true"), capture_output=True,
                       text=True, timeout=120)
  assert res.returncode == 1 and "1 error" in res.stdout, res.stdout[-2000:]
  assert "CI=true and .ci/run installs espeak-ng, so it must be present here" in res.stdout
