"""Internal. The one bounded cache of the package: recent results of a pure function, emptied when full.

Gathers repeat the same shapes, rank lists and routes call after call; what is worked out from them
(the encoder's layouts, the decoder's checked heads, a list's digest, a group's route, a peer's
address) is kept in a :class:`Recent` rather than redone. "Clear when full" keeps it simple and
bounded: a workload with more distinct keys than the bound only recomputes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["Recent"]

K = TypeVar("K")
V = TypeVar("V")


class Recent(dict[K, V]):
    """A dict of at most ``max_items`` recent results: ``get`` as a dict's; :meth:`put` (and
    :meth:`make`) drop them all first once it holds ``max_items``.

    Both are single dict operations, safe between threads (gathers on different groups): a result
    computed twice by a race is the same value.
    """

    __slots__ = ("max_items",)

    def __init__(self, max_items: int) -> None:
        super().__init__()
        self.max_items = max_items

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` under ``key`` (emptying the cache first when it is full); returns ``value``."""
        if len(self) >= self.max_items:
            self.clear()
        self[key] = value
        return value

    def make(self, key: K, make: Callable[[], V]) -> V:
        """The value kept under ``key``, else ``make()``, kept (see :meth:`put`)."""
        found = self.get(key)
        if found is None:
            found = self.put(key, make())
        return found
