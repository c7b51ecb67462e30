"""Name -> builder registries (modality kinds, recipes, codecs, envs, ...).

One registry per concept; looking up an unknown name raises one error that lists every
registered name, so a typo in a config says what would have been allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
  """A mapping from names to objects, filled by ``@registry.register('name')``."""

  def __init__(self, what: str):
    self.what = what
    self._items: dict[str, T] = {}

  def register(self, name: str, *, overwrite: bool = False) -> Callable[[T], T]:
    def deco(obj: T) -> T:
      self.add(name, obj, overwrite=overwrite)
      return obj
    return deco

  def add(self, name: str, obj: T, *, overwrite: bool = False) -> None:
    if not name or not isinstance(name, str):
      raise ValueError(f"{self.what} names must be non-empty strings, got {name!r}")
    if name in self._items and not overwrite:
      raise ValueError(f"{self.what} {name!r} is already registered")
    self._items[name] = obj

  def get(self, name: str) -> T:
    try:
      return self._items[name]
    except KeyError:
      raise KeyError(
          f"unknown {self.what} {name!r}; registered: {sorted(self._items)}") from None

  def names(self) -> list[str]:
    return sorted(self._items)

  def __contains__(self, name: object) -> bool:
    return name in self._items

  def __iter__(self) -> Iterator[str]:
    return iter(sorted(self._items))
