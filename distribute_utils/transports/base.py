"""The transport protocol: how one gather round moves payloads to the first rank.

A transport only moves bytes. The gather module (:mod:`distribute_utils.gather`) owns the
round: it checks agreement, picks the transport, signals through the CPU companion of the
group (:mod:`distribute_utils.sync`) and decodes what arrives.

Call order of one round, identified by ``token`` (fresh and unguessable per round, the same
on every rank of the round):

1. every sender (each participant except the first rank):
   ``publish(token, rank, payload)``; then the gather module posts "published" (or the error).
2. the first rank waits for every sender's "published", then calls ``fetch(token, rank)``
   once per sender, in the order of ``ranks``, and decodes the returned buffer.
3. the first rank posts "done" (or its error); every sender waits for it.
4. every sender: ``release(token, rank)``, also when anything above failed; it removes
   whatever ``publish`` left behind and must be idempotent.

``fetch`` returns a buffer that owns its memory (the decoded tensors are views of it and keep
it alive); nothing the transport made may remain visible to other processes once ``fetch``
has returned or ``release`` has run.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..wire import EncodedPayload

__all__ = ["Transport"]


class Transport(Protocol):
    """Moves one payload per sender to the first rank of a round (see module doc)."""

    name: str

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> None:
        """Make ``payload`` of ``rank`` available to the first rank. Senders only."""
        ...

    def fetch(self, token: str, rank: int) -> Any:
        """The payload ``rank`` published, as a buffer. First rank only, after "published"."""
        ...

    def release(self, token: str, rank: int) -> None:
        """Remove what ``publish`` made, if anything is left. Senders only; idempotent."""
        ...
