"""Internal. Fault-injection points: the one seam through which tests make a fault happen at a named step.

A module with fault points holds one :class:`FaultPoint` and calls its :attr:`~FaultPoint.hook`, when set,
at each named step (its module doc says which steps, and what a hook may do there); a test sets the hook
with the module's ``inject`` function and puts the one it replaced back.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["FaultPoint"]

H = TypeVar("H")


class FaultPoint(Generic[H]):
    """A hook a test sets (:meth:`inject`) and its module calls at its fault points (:attr:`hook`)."""

    def __init__(self) -> None:
        self.hook: H | None = None

    def inject(self, hook: H | None) -> H | None:
        """Set ``hook`` (None: no hook); returns the hook it replaces, to put back."""
        before, self.hook = self.hook, hook
        return before
