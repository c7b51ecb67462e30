"""System (apt) packages some tests need: skip with the install command, or fail under CI.

tests/lsm speaks its digits with espeak-ng; tests/dpad renders documents with the DejaVu
TrueType fonts. On a machine without them those tests skip with a message naming the package
and the command that installs it. Under CI (environment ``CI=true``, set by the CI runner)
``.ci/run`` installs both before the tests, so a missing one is an error there: the test
fails loudly instead of skipping silently. Presence is checked when the test runs (PATH and
the font folder are read then), so tests can monkeypatch them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import pytest

CI_TRUE = ("true", "1", "yes")


@dataclasses.dataclass(frozen=True)
class SystemPackage:
  """A Debian package a test needs; ``missing()`` says what is absent, or None."""
  what: str                              # e.g. "espeak-ng", "the DejaVu fonts"
  apt: str                               # the Debian / Ubuntu package name
  missing: Callable[[], str | None]

  @property
  def install(self) -> str:
    return f"apt-get install {self.apt}"


def _espeak_missing() -> str | None:
  from omni_jax.data import speech
  return None if speech.espeak_binary() else "no espeak-ng (or espeak) on PATH"


def _dejavu_missing() -> str | None:
  from omni_jax.dpad import documents
  absent = [f for f in documents.FONT_FILES
            if not os.path.isfile(os.path.join(documents.FONT_DIR, f))]
  return f"{', '.join(absent)} not in {documents.FONT_DIR}" if absent else None


ESPEAK_NG = SystemPackage("espeak-ng", "espeak-ng", _espeak_missing)
DEJAVU_FONTS = SystemPackage("the DejaVu fonts", "fonts-dejavu-core", _dejavu_missing)


def in_ci() -> bool:
  """True when the CI runner set ``CI`` (``true``, ``1`` or ``yes``, any case)."""
  return os.environ.get("CI", "").strip().lower() in CI_TRUE


def require(pkg: SystemPackage) -> None:
  """Returns when ``pkg`` is present; else skips the calling test with the install command,
  or, under CI, fails it (``.ci/run`` installs the package, so absence there is a bug)."""
  why = pkg.missing()
  if why is None:
    return
  msg = f"needs {pkg.what} ({why}): install it with `{pkg.install}`"
  if in_ci():
    pytest.fail(f"{msg}. CI=true and .ci/run installs {pkg.apt}, so it must be present "
                f"here", pytrace=False)
  pytest.skip(msg)
