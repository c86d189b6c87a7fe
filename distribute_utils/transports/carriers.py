"""Internal. The carriers by kind: receipts tagged and dispatched, publishing, and the fault-injection point.

The round (:mod:`distribute_utils.roles`) goes through this module only:

- a sender: :func:`publish` (through a :class:`.base.Carrier`; a :class:`.base.Route` picks one and calls
  it) returns a :class:`Sent`; its :attr:`Sent.receipt` travels in the claim, :meth:`Sent.release` ends it;
- the receiving side: :meth:`Receiving.fetch` / :meth:`Receiving.discard` find the carrier of a
  receipt by its tag (:func:`carrier_of`) and make it from the round's :class:`.base.Context`;
- :data:`reports`: what a receiver owes its senders in its verdict (the segment pool's freed
  reports, :class:`.shm.FreedReports`); :func:`remove_left_by`: a dead sender's half-published leftovers.

A receipt on the wire is ``[kind, data]``: ``kind`` names the carrier (:data:`KINDS`), ``data`` is
what its ``publish`` returned, opaque to everybody else.

Fault injection (tests): :func:`inject` sets one hook per process, called as
``hook(point, rank, carrier, value)`` at

- ``"published"``: a sender, its payload published (``value``: the carrier's receipt), before its
  claim goes (the collective: its receipt made, its bytes to go after the first rank's "go"); an
  exception raised there fails the send as any later one would (what was published is released first);
- ``"fetching"``: the receiving side, before it fetches ``rank``'s payload (``value``: the receipt):
  wait there for a sender to die, or die;
- ``"fetched"``: after it fetched (``value``: the buffer); a hook that returns something other than
  None replaces the buffer (a corrupt payload).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import PayloadError
from ..fault_points import FaultPoint
from ..wire import EncodedPayload
from .base import Carrier, Context, Sent
from .collective import CollectiveTransport
from .cuda_ipc import CudaIpcTransport
from .inline import AttachedCarrier, InlineCarrier
from .local_disk import LocalDiskCarrier
from .shm import REPORTS, FreedReports, SharedMemoryTransport
from .workspace import WorkspaceTransport

__all__ = [
    "KINDS",
    "FaultHook",
    "Receiving",
    "Sent",
    "carrier_of",
    "hooked",
    "inject",
    "names_token",
    "publish",
    "published",
    "remove_left_by",
    "reports",
]

logger = logging.getLogger(__name__)

KINDS: dict[str, type[Carrier]] = {
    cls.kind: cls
    for cls in (
        InlineCarrier,
        AttachedCarrier,
        SharedMemoryTransport,
        WorkspaceTransport,
        CollectiveTransport,
        CudaIpcTransport,
        LocalDiskCarrier,
    )
}
"""Every carrier, by the tag of its receipts."""

reports: FreedReports = REPORTS
"""A receiver's word to its senders, carried in claims and verdicts (see :class:`.shm.FreedReports`)."""

FaultHook = Callable[[str, int, Carrier, Any], Any]
_FAULTS: FaultPoint[FaultHook] = FaultPoint()


def inject(hook: FaultHook | None) -> FaultHook | None:
    """Call ``hook`` at this process's carrier fault points (see module doc; None: no hook). Returns
    the hook it replaces, to put back."""
    return _FAULTS.inject(hook)


def hooked() -> bool:
    """Whether a hook is set at this process's carrier fault points (a round that skips carriers then
    goes the general way, where every point runs)."""
    return _FAULTS.hook is not None


def publish(through: Carrier, token: str, rank: int, payload: EncodedPayload) -> Sent:
    """A sender: publish ``payload`` through a carrier (a :class:`.base.Route` calls it for the carrier it
    picks); the fault point ``"published"`` runs once it is out."""
    sent = Sent(through, token, through.publish(token, rank, payload), rank)
    return sent if _FAULTS.hook is None else published(sent)


def published(sent: Sent) -> Sent:
    """Run the fault point ``"published"`` for ``sent``: :func:`publish` does; a sender whose carrier
    sends its bytes only later (the collective, after the first rank's "go") calls it once its
    receipt is made."""
    if _FAULTS.hook is not None:
        try:
            _FAULTS.hook("published", sent.rank, sent.carrier, sent.data)
        except BaseException:
            sent.release(taken=False)
            raise
    return sent


def names_token(receipt: list[Any]) -> bool:
    """Whether the publication of ``receipt`` (``[kind, data]``, of a known kind: a :attr:`.base.Sent.receipt`
    or one a claim carries) has a name made from its token (the carrier's optional ``names_token``, see
    :class:`.base.Carrier`; absent: it has). Read by a sender's repeat after each publish and by the first
    rank's for each new claim."""
    names = getattr(KINDS[receipt[0]], "names_token", None)
    return True if names is None else bool(names(receipt[1]))


def carrier_of(receipt: Any, rank: int) -> type[Carrier]:
    """The carrier class that fetches ``receipt`` (posted by ``rank``); PayloadError for anything else."""
    if type(receipt) is list and len(receipt) == 2 and type(receipt[0]) is str:
        found = KINDS.get(receipt[0])
        if found is not None:
            return found
    raise PayloadError(f"rank {rank} published its payload with an unknown receipt {receipt!r:.80}")


class Receiving:
    """The receiving side of one round (a first rank, or a leader collecting its host): fetches each
    sender's payload from the carrier its receipt names, made from ``context`` (once per round for a
    carrier class that says it serves the whole round: ``one_per_round``, see :class:`.base.Carrier`)."""

    __slots__ = ("_kept", "context")

    def __init__(self, context: Context) -> None:
        self.context = context
        self._kept: dict[str, Carrier] = {}  # the round's carriers that serve every receipt of their kind

    def _carrier(self, rank: int, receipt: Any) -> Carrier:
        cls = carrier_of(receipt, rank)
        carrier = cls.receiving(self.context, rank, receipt[1])
        if getattr(cls, "one_per_round", False):
            self._kept[receipt[0]] = carrier
        return carrier

    def fetch(self, token: str, rank: int, receipt: Any) -> Any:
        """The buffer of ``rank``'s payload (fault points ``"fetching"`` and ``"fetched"``)."""
        carrier = None  # (a kept one without a call: once per sender of a small gather)
        if type(receipt) is list and len(receipt) == 2 and type(receipt[0]) is str:
            carrier = self._kept.get(receipt[0])
        if carrier is None:
            carrier = self._carrier(rank, receipt)
        if _FAULTS.hook is not None:
            _FAULTS.hook("fetching", rank, carrier, receipt[1])
        buffer = carrier.fetch(token, rank, receipt[1])
        if _FAULTS.hook is not None:
            replaced = _FAULTS.hook("fetched", rank, carrier, buffer)
            if replaced is not None:
                buffer = replaced
        return buffer

    def discard(self, token: str, rank: int, receipt: Any) -> None:
        """Remove what ``rank`` published and will not be fetched (a dead sender cannot)."""
        self._carrier(rank, receipt).discard(token, rank, receipt[1])


def remove_left_by(rank: int | None, pid: int) -> list[str]:
    """Remove what sender ``rank`` (any rank: None) of process ``pid`` (dead before it claimed: its token was never told)
    left half-published on this host, in every carrier that leaves something a dead process cannot
    remove (``remove_left_by``, see :class:`.base.Carrier`); the paths removed."""
    removed: list[str] = []
    for cls in KINDS.values():
        remove = getattr(cls, "remove_left_by", None)
        if remove is not None:
            removed += remove(rank, pid)
    return removed
