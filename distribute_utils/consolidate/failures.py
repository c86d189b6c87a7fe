"""Internal. A rank's first error in a consolidation, how it travels, and the error the other ranks raise.

A failure on any rank (a ``same`` tensor that differs, a full disk, a bad shard) must not leave the others
hanging: the rank's :class:`Failures` records it (:meth:`Failures.guard`) and the rank keeps taking part in
the remaining rounds with a marker (:meth:`Failures.marker`) instead of data; the marker travels to
rank 0, and a final exchange makes every rank raise: the originating rank its own exception, the others
:class:`ConsolidationError` naming it. Only a lost peer (:class:`~distribute_utils.errors.PeerLostError`)
is raised at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import ConsolidationError, PeerLostError, one_line

__all__ = ["ConsolidationError", "Failure", "Failures"]

logger = logging.getLogger(__name__)


@dataclass
class Failure:
    """The first error seen by a rank: its own, or one forwarded from the rank that had it."""

    rank: int
    kind: str
    message: str
    exc: BaseException | None = None  # set on the originating rank only

    def wire(self) -> list[Any]:
        """``[rank, kind, message]``: what travels (the exception stays here)."""
        return [self.rank, self.kind, self.message]

    @classmethod
    def from_wire(cls, value: Sequence[Any]) -> Failure:
        """The inverse of :meth:`wire`."""
        rank, kind, message = value
        return cls(int(rank), str(kind), str(message))

    @classmethod
    def first_of(cls, markers: Sequence[Sequence[Any] | None]) -> Failure | None:
        """The failure to report from every rank's marker (index: rank): a rank's own error before one it
        only forwarded; ``None`` if no rank failed."""
        origin = next((m for r, m in enumerate(markers) if m is not None and m[0] == r), None)
        if origin is not None:
            return cls.from_wire(origin)
        return next((cls.from_wire(m) for m in markers if m is not None), None)

    def error(self, me: int) -> BaseException:
        """What rank ``me`` raises: the exception itself on the originating rank, else a
        :class:`ConsolidationError` naming it."""
        if self.exc is not None and self.rank == me:
            return self.exc
        return ConsolidationError(self.message, self.rank, self.kind)


class Failures:
    """One rank's record of the first failure it saw (its own or a peer's); one thread.

    Attributes:
        rank: this rank.
        first: the failure, ``None`` while there is none.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.first: Failure | None = None

    @property
    def failed(self) -> bool:
        """Whether a failure was seen (the rank drains the remaining rounds)."""
        return self.first is not None

    def fail(self, exc: BaseException) -> None:
        """Records this rank's own error (the first one counts); a lost peer is raised at once."""
        if isinstance(exc, PeerLostError):
            raise exc
        if self.first is None:
            self.first = Failure(self.rank, type(exc).__name__, one_line(exc), exc)
            logger.debug("rank %d failed; draining the remaining rounds", self.rank, exc_info=True)

    def note(self, marker: Sequence[Any] | None) -> None:
        """Records a peer's marker (from :meth:`marker`) unless a failure is known already."""
        if marker is not None and self.first is None:
            self.first = Failure.from_wire(marker)

    def marker(self) -> list[Any] | None:
        """What this rank sends instead of data once it failed (``None``: no failure)."""
        return self.first.wire() if self.first is not None else None

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Records an error (draining from then on) instead of raising it; a lost peer is raised."""
        try:
            yield
        except Exception as exc:
            self.fail(exc)

    def error_for(self, failure: Failure) -> BaseException:
        """What this rank raises for ``failure``: its own exception if it is the originating rank."""
        if self.first is not None and self.first.exc is not None and self.first.rank == failure.rank:
            return self.first.exc
        return failure.error(self.rank)
