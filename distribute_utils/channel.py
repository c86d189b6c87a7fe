"""Internal. How one gather call's claims and verdicts travel: the store, or this host's mailboxes.

A gather call (:mod:`distribute_utils.roles`) is one hop each way: every sender posts one *claim*
(what it sends and where its payload is), the first rank reads its own participants' claims and posts
one *verdict*, which each sender awaits. A :class:`Channel` carries those bytes; the round builds them,
reads them and never asks which channel it has. Two implementations:

- :class:`StoreChannel`: keys of the call in the group's namespace of the job's store (a sender's
  claim ``c/<rank>``, the first rank's claim ``c/<first>`` and verdict ``v/<first>``); it works
  between any ranks.
- :class:`MailboxChannel`: datagrams between the processes of one host
  (:mod:`distribute_utils.mailbox`), nothing in the store while all goes well; a sender's payload may
  travel inside its claim message (``attached``). A rank that gives up also posts what a store round
  would hold, so that a partner that went through the store hears it there.

Call order, on each rank of one gather, from the thread that runs the call:

- a **sender**: :meth:`~Channel.post_claim` once, then :meth:`~Channel.await_verdict` once; when
  anything fails (before, between or in them), :meth:`~Channel.give_up` with its failed claim.
- the **first rank**: :meth:`~Channel.post_claim` with its own claim, :meth:`~Channel.claims` once,
  then :meth:`~Channel.post_verdict`; when anything fails, :meth:`~Channel.give_up` with its failed
  claim and verdict instead of posting the verdict.

Every wait is bounded by the channel's ``timeout`` and names the ranks that did not come
(:class:`~distribute_utils.errors.PeerLostError`).
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from .errors import PayloadError
from .liveness import GRACE_S
from .mailbox import Line
from .sync import RETRY_S, Call, GroupSync

__all__ = ["Buffer", "Channel", "Judge", "Known", "MailboxChannel", "StoreChannel", "Take"]

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
Judge = Callable[[int, "list[Any] | str | None"], bool]
"""Reads a partner's answer to "what do you do in this call" (see :meth:`Call.receive_direct`)."""
Take = Callable[[int, Buffer, "memoryview | None"], None]
"""Takes one sender's claim as it comes: ``(rank, claim, attached payload or None)``; may raise."""
Known = Callable[[int, memoryview, memoryview], bool]
"""Takes one sender's claim and attached payload as they come (a repeat's: False, not taken); may raise."""

SMALL_CLAIM_BYTES = 4096  # larger claims (inline payloads) are overwritten once taken, not kept
_CLAIM, _VERDICT = 0, 1  # kinds of direct messages (distribute_utils.mailbox)
_CLAIM_LENGTH = struct.Struct("<I")  # a direct claim message: its length, the claim, an attached payload


class Channel(Protocol):
    """Carries one gather call's claims and verdicts (see the module doc for the call order)."""

    path: str
    """How this rank's record names the round it takes ("store" or "direct"; read by partners)."""
    attach_max: int
    """Payload bytes that may travel inside a sender's claim message (0: none)."""
    hears_all: bool
    """Whether :meth:`claims` can hear every participant, also one that took the other channel."""
    one_host: bool
    """Whether every participant runs on this host (then a sender sends straight to its first rank)."""

    @property
    def delivered(self) -> bool:
        """Whether this rank's claim has reached its first rank's side (its notes went with it)."""
        ...

    def post_claim(self, claim: bytes, attached: Sequence[Buffer] = ()) -> None:
        """Post this rank's claim (a sender's with its ``attached`` payload, at most :attr:`attach_max`
        bytes). Every participant, once, first."""
        ...

    def claims(self, senders: Sequence[int], what: str, judge: Judge, take: Take) -> None:
        """The first rank: hand each of ``senders``' claims to ``take`` as it comes (``judge`` reads a
        late partner's answer where the channel can ask). Raises what ``take`` raised, or
        :class:`~distribute_utils.errors.PeerLostError` naming the senders that did not come."""
        ...

    def post_verdict(self, verdict: bytes, senders: Sequence[int], what: str) -> None:
        """The first rank, all claims taken: post ``verdict`` to ``senders``."""
        ...

    def await_verdict(self, what: str, judge: Judge) -> Buffer:
        """A sender, its claim posted: its first rank's verdict (or what stands for the verdict of a rank
        that does not receive, when it named one as its first rank)."""
        ...

    def give_up(self, claim: bytes, verdict: bytes | None = None, failed: Collection[int] = ()) -> None:
        """This rank failed: post ``claim`` (carrying the error) and, the first rank, ``verdict``,
        wherever a partner may look for them (``failed``: senders whose claims carried an error: they
        wait for no verdict). Raises PeerLostError when the store is gone."""
        ...


class StoreChannel:
    """Claims and verdicts as keys of ``call`` in the job's store.

    A rank posts one key, its claim; the first rank its verdict too. ``stand_in(claim)`` is what stands
    for the verdict of a rank whose claim says it does not receive (None for a receiver's claim): a sender
    that wrongly takes that rank for its first rank hears it from the watchdog within about a second
    (see :meth:`~distribute_utils.sync.Call.wait_verdict`), and no rank posts a verdict key just in case. ``taken()`` is what replaces claims larger than :data:`SMALL_CLAIM_BYTES` once the verdict is
    posted (their inline payloads are not kept).
    :meth:`claims` hands every claim over, also after ``take`` raised, then raises the first error: a
    failing round can then discard what each sender published.
    """

    path = "store"
    attach_max = 0
    hears_all = True
    one_host = False  # (it may: the plan says)

    def __init__(
        self,
        call: Call,
        first: int,
        timeout: float,
        *,
        stand_in: Callable[[bytes], bytes | None],
        taken: Callable[[], bytes],
    ) -> None:
        self.call, self.first, self.timeout = call, first, timeout
        self.stand_in, self.taken = stand_in, taken
        self._posted = False
        self._bulky: list[int] = []

    @property
    def delivered(self) -> bool:
        return self._posted

    def post_claim(self, claim: bytes, attached: Sequence[Buffer] = ()) -> None:
        assert not attached, "the store carries no payload inside a claim (attach_max is 0)"
        self.call.post({"c": claim})
        self._posted = True

    def claims(self, senders: Sequence[int], what: str, judge: Judge, take: Take) -> None:
        values = self.call.wait_for("c", senders, self.timeout, what)
        self._bulky = [r for r, v in zip(senders, values) if len(v) > SMALL_CLAIM_BYTES]
        error: Exception | None = None
        for rank, value in zip(senders, values):
            try:
                take(rank, value, None)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def post_verdict(self, verdict: bytes, senders: Sequence[int], what: str) -> None:
        bulky = self._bulky
        self.call.post({"v": verdict}, ("c", bulky, self.taken() if bulky else b""))

    def await_verdict(self, what: str, judge: Judge) -> Buffer:
        return self.call.wait_verdict(self.first, self.timeout, what, self.stand_in)

    def give_up(self, claim: bytes, verdict: bytes | None = None, failed: Collection[int] = ()) -> None:
        values: dict[str, bytes] = {}
        if not self._posted:
            values["c"] = claim
        if verdict is not None:
            values["v"] = verdict
        if values:
            self.call.post(values)
            self._posted = True


GIVE_UP_WAIT_S = 1.0
"""How long a rank that gives up waits for room in a partner's queue (see :meth:`MailboxChannel.give_up`)."""


class MailboxChannel:
    """Claims and verdicts as datagrams between the mailboxes of ``ranks`` (all on this host, in one pid
    and network namespace: see :meth:`~distribute_utils.sync.GroupSync.direct`).

    A sender's claim that its first rank did not take yet (not listening yet, its queue full) is sent
    again while the sender waits for its verdict. :meth:`give_up` tells the partners directly where it
    can, and posts in the store what a :class:`StoreChannel` would hold (``store()`` makes that one,
    for this call, only then).
    """

    path = "direct"
    hears_all = False
    one_host = True

    def __init__(
        self,
        call: Call,
        ranks: Sequence[int],
        timeout: float,
        store: Callable[[], StoreChannel],
        attach_max: int,
    ) -> None:
        self.call, self.ranks, self.first, self.timeout = call, ranks, ranks[0], timeout
        self.store, self.attach_max = store, attach_max
        self.receiver = call.sync.rank == self.first
        self._delivered = False
        self._message: list[Buffer] = []

    @property
    def delivered(self) -> bool:
        return self._delivered

    def post_claim(self, claim: bytes, attached: Sequence[Buffer] = ()) -> None:
        if self.receiver:
            return  # its claim is its record: a sender past the grace asks for it
        self._message = self.claim_message(claim, attached)
        self._delivered = self.call.send_direct(self.first, _CLAIM, self._message, GRACE_S)

    def claims(self, senders: Sequence[int], what: str, judge: Judge, take: Take) -> None:
        def arrived(rank: int, data: bytearray) -> None:
            message = memoryview(data)
            try:
                (length,) = _CLAIM_LENGTH.unpack_from(message)
            except struct.error as exc:
                raise PayloadError(f"rank {rank} sent a malformed claim: {exc}") from None
            end = _CLAIM_LENGTH.size + length
            take(rank, message[_CLAIM_LENGTH.size : end], message[end:])

        self.call.receive_direct(_CLAIM, senders, self.timeout, what, judge, arrived)

    def post_verdict(self, verdict: bytes, senders: Sequence[int], what: str) -> None:
        call = self.call
        sync = call.sync
        addresses = sync.addresses
        # Each waits in its mailbox, so there is room; one that left is not told.
        for i in sync.mailbox().send_each(
            [addresses[r] for r in senders], call.number, sync.rank, _VERDICT, [verdict], GRACE_S
        ):
            logger.warning("%s: rank %d no longer listens for its verdict", what, senders[i])

    def await_verdict(self, what: str, judge: Judge) -> Buffer:
        call = self.call
        found: dict[int, bytearray] = {}
        if self._delivered:  # (most calls: nothing to send again)
            call.receive_direct(
                _VERDICT, [self.first], self.timeout, what, judge, found.__setitem__, None, True
            )
            return found[self.first]

        def undelivered() -> bool:  # the first rank did not listen yet, or its queue was full
            self._delivered = self._delivered or call.send_direct(self.first, _CLAIM, self._message, RETRY_S)
            return not self._delivered

        call.receive_direct(
            _VERDICT,
            [self.first],
            self.timeout,
            what,
            judge,
            found.__setitem__,  # (rank, verdict): no Python call per verdict
            undelivered,
            second_chance=True,
        )
        return found[self.first]

    # -- a repeat's (distribute_utils.roles.repeat): the round that goes well, without the general wait --
    @staticmethod
    def claim_line(sync: GroupSync, first: int) -> Line:
        """A sender's kept :class:`~distribute_utils.mailbox.Line` to ``first``, its first rank in a direct
        round of ``sync``'s group: its claim messages (:meth:`claim_message`) out, its verdict back. A repeat
        that sent its claim through it and heard no success hands the call over with :meth:`claimed`; one
        whose line did not send posts it with :meth:`claim_and_hear`."""
        return sync.mailbox().line(sync.rank, first, sync.infos[first], _CLAIM, _VERDICT)

    @staticmethod
    def claim_message(claim: bytes, attached: Sequence[Buffer]) -> list[Buffer]:
        """The parts of a direct claim message: ``claim``, then the payload ``attached`` to it (what
        :meth:`post_claim` sends; a sender's repeat makes the parts before its payload once per claim)."""
        return [_CLAIM_LENGTH.pack(len(claim)), claim, *attached]

    def claimed(self, message: list[Buffer]) -> None:
        """A repeat sent this call's claim ``message`` (:meth:`claim_message`) itself: the channel holds it,
        delivered, for :meth:`await_verdict` (and a give-up)."""
        self._message, self._delivered = message, True

    def claim_and_hear(self, line: Line, message: list[Buffer], expected: bytes) -> bool:
        """A sender's repeat whose ``line`` (:meth:`claim_line`) did not send: post the claim ``message``
        (:meth:`claim_message`) as :meth:`post_claim` posts a claim, then whether the one message its first
        rank sent it within the grace is the verdict ``expected`` (``line.hear``: anything else it read is
        put back for :meth:`await_verdict`). A claim that cannot go at once is posted as :meth:`post_claim`
        posts it, and False is returned: :meth:`await_verdict` then waits for the verdict."""
        call = self.call
        sync = call.sync
        mailbox = sync.mailbox()
        self._message = message
        address = sync.addresses[self.first]
        if not mailbox.send_now(address, call.number, sync.rank, _CLAIM, message):
            self._delivered = mailbox.send_to(address, call.number, sync.rank, _CLAIM, message, GRACE_S)
            return False
        self._delivered = True
        return line.hear(call.number, expected, min(GRACE_S, self.timeout))

    def take_known(self, senders: Sequence[int], known: Known) -> list[int]:
        """The first rank: hand each of ``senders``' claims that come within the grace to ``known`` (as
        :meth:`claims` hands them to ``take``), until it returns False for one or none comes in time; that
        one and what came with it are put back for :meth:`claims`. Returns the senders not taken."""
        sync = self.call.sync
        mailbox = sync.mailbox()
        number = self.call.number
        missing = {r: sync.infos[r] for r in senders}
        wait = min(GRACE_S, self.timeout)
        while missing:
            got = mailbox.take_next(number, missing, _CLAIM, wait)  # (anything else: left for claims())
            if got is None:
                break
            rank, data = got
            message = memoryview(data)
            if len(data) < _CLAIM_LENGTH.size:
                mailbox.unread(number, [(rank, _CLAIM, data)], missing)
                break
            end = _CLAIM_LENGTH.size + _CLAIM_LENGTH.unpack_from(message)[0]
            if not known(rank, message[_CLAIM_LENGTH.size : end], message[end:]):
                mailbox.unread(number, [(rank, _CLAIM, data)], missing)
                break
            del missing[rank]
        return list(missing)

    def unread(self, messages: list[tuple[int, int, bytearray]], senders: dict[int, Any]) -> None:
        if messages:
            sync = self.call.sync
            sync.mailbox().unread(self.call.number, messages, senders)

    def give_up(self, claim: bytes, verdict: bytes | None = None, failed: Collection[int] = ()) -> None:
        # Each send waits a little while its partner's queue is full (GIVE_UP_WAIT_S): a rank that fails
        # call after call returns at once each time, and would otherwise run ahead of its partners, its
        # messages dropped (a queue holds 10), until they find it gone past (or exited) instead of hearing
        # its error. A partner in a round reads within that; one that is gone refuses at once; one that
        # failed waits for no verdict (it may read none for many calls): not waited for. Bounded (each
        # partner's send at most GIVE_UP_WAIT_S), never the call's timeout: two ranks that give up to
        # each other at once must not wait on each other.
        wait = min(self.timeout, GIVE_UP_WAIT_S)
        with contextlib.suppress(OSError):  # else they hear it from its record, or from the store
            if self.receiver and verdict is not None:
                for rank in self.ranks[1:]:
                    if rank not in failed:
                        self.call.send_direct(rank, _VERDICT, [verdict], wait)
            elif not self.receiver and not self._delivered:
                self.call.send_direct(self.first, _CLAIM, self.claim_message(claim, ()), wait)
        self.store().give_up(claim, verdict, failed)
