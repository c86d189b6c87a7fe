"""Internal. Carriers with no medium of their own: the payload travels inside the sender's claim.

- :class:`InlineCarrier` (``"inline"``): the bytes are the receipt, in the claim the store holds (up
  to :data:`INLINE_MAX_BYTES`).
- :class:`AttachedCarrier` (``"attached"``): a direct round's claim is one datagram
  (:mod:`distribute_utils.mailbox`); the payload follows the claim in it (the round sends
  :attr:`AttachedCarrier.outgoing` after the claim), and the receipt is only its length. The receiving
  side's round puts what followed each claim in :attr:`.base.Context.arrived`.

Nothing to remove afterwards: neither leaves anything behind.
"""

from __future__ import annotations

from typing import Any

from ..errors import PayloadError
from ..owners import owned
from ..wire import EncodedPayload
from .base import Context, Destination
from .segment_pool import SegmentPool

__all__ = ["INLINE_MAX_BYTES", "AttachedCarrier", "InlineCarrier"]

INLINE_MAX_BYTES = 64 * 2**10
"""Payloads up to this size travel inside the sender's claim in the store, not through a file: creating,
sizing, mapping and removing a segment costs more than sending the bytes (measured: ``docs/performance.md``)."""


class InlineCarrier:
    """The payload's bytes as the receipt (copied to the CPU first); implements :class:`.base.Carrier`."""

    kind = "inline"
    done_when_answered = False
    scope = "any"  # (the claim is in the job's store)
    medium = "claim"
    max_bytes: int | None = INLINE_MAX_BYTES
    label = "the sender's claim"
    devices = "to_cpu"
    needs_go = False
    checksums = False
    settings: tuple[str, ...] = ()
    one_per_round = True  # (one instance for every round: see receiving)

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> bytes:
        return payload.to_cpu().to_bytes()

    def fetch(self, token: str, rank: int, receipt: Any) -> bytearray:
        if type(receipt) is not bytes:
            raise PayloadError(f"rank {rank} published an inline payload that is not bytes: {receipt!r:.80}")
        return bytearray(receipt)  # writable, so that tensors decode writable

    def discard(self, token: str, rank: int, receipt: Any) -> None:
        """Nothing to remove."""

    def release(self, token: str, rank: int, receipt: Any, *, taken: bool = True) -> None:
        """Nothing to remove."""

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> InlineCarrier:
        return INLINE

    @classmethod
    def sending(cls, destination: Destination) -> InlineCarrier:
        return INLINE


INLINE = InlineCarrier()


class AttachedCarrier:
    """The payload after the claim in a direct round's message; implements :class:`.base.Carrier`.

    Args:
        arrived: the receiving side's payloads that came with each sender's claim (rank -> buffer).
    """

    kind = "attached"
    done_when_answered = False
    scope = "host"  # (a datagram between processes of one host)
    medium = "datagram"  # (the direct round's own: never in a host route)
    max_bytes: int | None = None  # (the round decides: see roles.part.ATTACHED_MAX_BYTES)
    label = "the sender's claim message"
    devices = "to_cpu"
    needs_go = False
    checksums = False
    settings: tuple[str, ...] = ()
    one_per_round = True  # (the receiving side's one reads the round's context.arrived)
    __slots__ = ("arrived", "outgoing")

    def __init__(self, arrived: dict[int, Any] | None = None) -> None:
        self.arrived = {} if arrived is None else arrived
        self.outgoing: EncodedPayload | None = None  # a sender's payload, for its claim message

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> int:
        """Keep ``payload`` (on the CPU) as :attr:`outgoing`; the receipt is its length."""
        owned(SegmentPool).note_payload(payload.nbytes, pooled=False)  # (it sizes itself by every payload)
        self.outgoing = payload.to_cpu()
        return payload.nbytes

    def fetch(self, token: str, rank: int, receipt: Any) -> Any:
        """What came with ``rank``'s claim, checked against the length its receipt states."""
        found = self.arrived.pop(rank, None)
        if found is None or found.nbytes != receipt:
            size = "no" if found is None else f"{found.nbytes} bytes of"
            raise PayloadError(f"rank {rank} sent {size} payload with its claim, which says {receipt}")
        return found

    def discard(self, token: str, rank: int, receipt: Any) -> None:
        self.arrived.pop(rank, None)

    def release(self, token: str, rank: int, receipt: Any, *, taken: bool = True) -> None:
        self.outgoing = None

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> AttachedCarrier:
        return cls(context.arrived)
