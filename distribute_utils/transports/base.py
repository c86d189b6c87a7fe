"""The transport protocol: how one gather round moves payloads to the first rank.

A transport only moves bytes. The gather module (:mod:`distribute_utils.gather`) owns the
round: it checks agreement, plans the route (which transport carries each sender's payload),
signals through the CPU companion of the group (:mod:`distribute_utils.sync`) and decodes what
arrives. As torch DCP's storage layer hands its planner opaque ``storage_data``, a transport
hands the gather an opaque *receipt*: a msgpack-able value that the gather carries to the
receiver in the sender's claim and gives back, unread, to the same transport.

Call order of one round, for one sender ``rank`` and its ``token`` (fresh and unguessable, chosen
by the sender and carried in its claim):

1. sender: ``receipt = publish(token, rank, payload)``; the gather posts the receipt (or the
   error) in the sender's claim.
2. receiver, once the claim is there: ``buffer = fetch(token, rank, receipt)``, then decodes it.
   If the round fails before it fetched: ``discard(token, rank, receipt)`` (a dead sender cannot
   clean up; idempotent).
3. the receiver posts its verdict; the sender waits for it.
4. sender: ``release(token, rank, receipt, taken=...)``, also when anything above failed
   (``taken=False``: no verdict came, the receiver may still hold the buffer); it removes whatever
   ``publish`` left and must be idempotent.

``fetch`` returns a buffer that owns its memory (decoded tensors are views of it and keep it
alive); nothing the transport made may stay visible to other processes once ``fetch`` has
returned or ``release`` has run.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..wire import EncodedPayload

__all__ = ["Transport"]


class Transport(Protocol):
    """Moves one payload per sender to the first rank of a round (see module doc)."""

    name: str

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> Any:
        """Make ``payload`` of ``rank`` available to the first rank; returns the receipt. Senders only."""
        ...

    def fetch(self, token: str, rank: int, receipt: Any) -> Any:
        """The payload ``rank`` published, as a buffer. First rank only, once it has the receipt."""
        ...

    def discard(self, token: str, rank: int, receipt: Any) -> None:
        """Remove what ``rank`` published and the first rank will not fetch. First rank only; idempotent."""
        ...

    def release(self, token: str, rank: int, receipt: Any, *, taken: bool = True) -> None:
        """Remove what ``publish`` made, if anything is left. Senders only; idempotent."""
        ...
