"""Internal. What every rank's part in one gather call shares: the list, the messages, the channel, the records.

A gather call (see :mod:`distribute_utils.roles`) gives each rank one of three roles
(:class:`~.sender.Sender`, :class:`~.first_rank.FirstRank`, :class:`~.check_in.CheckIn`), each a
:class:`Part`: one rank's part in one call, over the call's :class:`Round`. What they share is here:

- :class:`RankList`: a checked ranks list and the packed messages that come back call after call;
- :class:`Claim` and :class:`Verdict`: what ranks post, and errors packed for other ranks
  (:func:`error_of`) and raised from them (:func:`raise_from`);
- :class:`Part`: the channel the call's claims and verdicts travel through (:meth:`Part.decide`), this
  rank's record for partners past the grace (:meth:`Part.record`), the checks of a sender's claim,
  the receiving carriers (a first rank's, a leader's) and the carriers' notes this rank owes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, NamedTuple, NoReturn

import msgpack
import torch
import torch.distributed as dist

from .. import sync
from ..caches import Recent
from ..channel import Channel, MailboxChannel, StoreChannel
from ..errors import ArgumentError, GatherError, PayloadError, PeerLostError, rebuilt
from ..transports import carriers
from ..transports.base import Carrier, Context
from ..transports.router import Request

__all__ = [
    "ATTACHED_MAX_BYTES",
    "Claim",
    "Part",
    "RankList",
    "Round",
    "Verdict",
    "error_of",
    "mismatch",
    "modes_differ",
    "not_direct",
    "raise_from",
    "stand_in",
]

logger = logging.getLogger(__name__)

ATTACHED_MAX_BYTES = 288 * 2**10
"""In a direct round, payloads up to this size travel in the claim's message (no file; copied once by
the receiving process, not at all by the sender's); larger ones as :data:`~distribute_utils.transports.inline.INLINE_MAX_BYTES` says."""


class RankList:
    """A checked ranks list, and what every gather call with it shares: its digest, how messages
    show it, and the packed messages that come back call after call (:attr:`success`, :meth:`kept`).
    Made once per list and group (by ``gather_on``'s checks); nothing else of it changes."""

    __slots__ = ("_kept", "digest", "first", "members", "ranks", "shown", "success", "what")

    def __init__(self, ranks: list[int], digest: str) -> None:
        self.ranks, self.first, self.digest = ranks, ranks[0], digest
        self.members = frozenset(ranks)
        self.shown = ranks if len(ranks) <= 64 else None  # (in messages: a long list is left out)
        self.what = f"gather to rank {self.first}"
        self._kept: Recent[tuple[Any, ...], bytes] = Recent(256)
        # The first rank's verdict when all went well and it has no notes to pass on.
        self.success = Verdict(True, self.shown, digest, None, []).pack()

    def kept(self, key: tuple[Any, ...], make: Callable[[], bytes]) -> bytes:
        """``make()``, kept under ``key`` (a message of this list: what it says besides the list)."""
        found = self._kept.get(key)  # (as Recent.make, without its call: once per call of a gather)
        return self._kept.put(key, make()) if found is None else found


# -- what ranks post -------------------------------------------------------------------------------
class Claim(NamedTuple):
    """What one rank posts at the start of a gather call (key ``c/<rank>``).

    ``kind`` is "first" (it receives), "send" (``body`` is ``[token, receipt]``: where its
    payload is, in the words of the transport that carried it) or "none"
    (its own list does not name it: it only checks in). A rank that wrongly takes a rank that does not
    receive for its receiver hears why from that rank's claim (:func:`stand_in`), instead of waiting.
    ``notes`` are the carriers' word for other senders of this gather that this rank holds (a leader
    let their segments go): the first rank passes them on in its verdict.
    """

    kind: str
    ranks: list[int] | None  # shown in messages (None when too long)
    digest: str
    mode: str
    error: Sequence[Any] | None  # (exception type name, message[, missing ranks]); a list once it travelled
    body: list[Any] | None = None
    notes: list[Any] | None = None

    def pack(self) -> bytes:
        return msgpack.packb(self)  # an array of the fields, in order

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Claim:
        return cls._make(msgpack.unpackb(data))  # raises TypeError when the fields do not match


class Verdict(NamedTuple):
    """What a receiver posts under ``v/<rank>``; with ``receiver`` False, what stands for it in the key of
    a rank that does not receive (:func:`stand_in`)."""

    receiver: bool
    ranks: list[int] | None
    digest: str
    error: Sequence[Any] | None = None  # the receiver failed: as in a claim
    notes: Sequence[Any] = ()  # the carriers' word to its senders (carriers.reports)

    def pack(self) -> bytes:
        return msgpack.packb(self)  # an array of the fields, in order

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Verdict:
        return cls._make(msgpack.unpackb(data))  # raises TypeError when the fields do not match


def stand_in(claim: bytes) -> bytes | None:
    """What stands for the verdict of the rank that posted ``claim`` when it does not receive: a
    :class:`Verdict` with ``receiver`` False and that rank's list, which makes a sender that waits on
    it raise :func:`mismatch`; None for a receiver's claim (its verdict will come). Read by the
    watchdog (:class:`~distribute_utils.liveness.StandIn`)."""
    found = Claim.unpack(claim)
    return None if found.kind == "first" else Verdict(False, found.ranks, found.digest).pack()


def error_of(exc: BaseException) -> tuple[Any, ...]:
    """An error as it travels to other ranks: type name, message, and the ranks it names."""
    missing = list(getattr(exc, "missing", ()) or ())
    return (
        (type(exc).__name__, str(exc)[:4096], missing) if missing else (type(exc).__name__, str(exc)[:4096])
    )


def raise_from(error: Sequence[Any], prefix: str) -> NoReturn:
    """Raise an error another rank posted (``prefix`` names that rank): as its own type when it is one
    of ours or a plain ``TypeError`` / ``ValueError`` (:func:`~distribute_utils.errors.rebuilt`), else as
    :class:`GatherError` naming the type."""
    kind, message = str(error[0]), str(error[1])
    exc = rebuilt(kind, f"{prefix}{message}", error[2] if len(error) > 2 else ())
    if exc is None:
        prefix = prefix.replace("cannot take part in the gather: ", "failed: ")
        raise GatherError(f"{prefix}{kind}: {message}" if prefix else f"{kind}: {message}")
    raise exc


def mismatch(me: int, mine: list[int] | None, other: int, theirs: list[int] | None) -> ArgumentError:
    return ArgumentError(
        f"ranks disagree on a gather: rank {me} passed ranks={mine}, but rank {other}, which it names, "
        f"passed ranks={theirs}; every rank named in a list must pass that same list (lists may differ "
        "between ranks only when they share no rank)"
    )


def modes_differ(me: int, mine: str, other: int, theirs: str) -> ArgumentError:
    return ArgumentError(
        f"ranks asked for different transports: rank {me} {mine!r}, rank {other} "
        f"{theirs!r} (transport:has-workspace); pass the same everywhere"
    )


def not_direct(me: int, other: int) -> ArgumentError:
    return ArgumentError(
        f"rank {other} takes part in this gather through the store while rank {me} sends through "
        "this host's sockets (distribute_utils.mailbox): it could not listen for direct messages "
        "(see its log), or the ranks asked for different transports; pass the same everywhere"
    )


Round = tuple[
    sync.GroupSync,  # companion
    sync.Call,  # call
    Request,  # transport (router.request: parsed at the API's edge)
    "str | PathLike[str] | None",  # workspace_path
    float,  # seconds
    "dist.ProcessGroup | Sequence[int] | None",  # group
    str,  # root
]
"""One gather call as each rank's part sees it: ``(companion, call, transport, workspace_path, seconds,
group, root)``, the companion and call it runs over and the caller's options (a bad one is posted in this
rank's claim: see ``gather_on``). A plain tuple: one is made per call, on every rank, and only
:class:`Part` reads it."""


# -- one rank's part in one gather call ------------------------------------------------------------
class Part:
    """One rank's part in one gather call: what its three roles share (see the module doc). Made once
    per call, as the role the rank has in it."""

    def __init__(self, round_: Round, listed: RankList) -> None:
        companion, call, asked, workspace_path, seconds, group, root = round_
        self.companion, self.call, self.listed, self.ranks = companion, call, listed, listed.ranks
        self.me, self.first = companion.rank, listed.first
        self.digest, self.shown = listed.digest, listed.shown
        self.request, self.workspace_path = asked, workspace_path
        self.mode = f"{asked.name}:{workspace_path is not None}"
        self.seconds, self.group, self.root = seconds, group, root
        self.what = listed.what
        self._attached_in: dict[int, memoryview] = {}  # the first rank's: each sender's, as it came
        self._notes_taken: list[Any] = []  # this rank's own notes, posted in its claim or verdict

    # State that most calls never change (class defaults: nothing to set up per call).
    _workspace: Carrier | None = None
    _receiving: carriers.Receiving | None = None
    _ipc_to: torch.device | None = None  # the first rank: the GPU it decodes to, where CUDA IPC copies to
    pin_maps = False  # the first rank copies what it receives to a GPU (see FirstRank.receive)

    # -- shared helpers ------------------------------------------------------------------------
    @property
    def workspace(self) -> Carrier:
        """The workspace carrier of the job (made on first use; sweeps dead jobs' leftovers)."""
        if self._workspace is None:
            from ..transports.namespace import job_token
            from ..transports.workspace import WorkspaceTransport

            if self.workspace_path is None:
                raise ArgumentError("this gather needs a workspace_path (a directory every rank can reach)")
            self._workspace = WorkspaceTransport(
                self.workspace_path, job_token(), self.seconds, sweep_stale=True
            )
        return self._workspace

    def claim(
        self,
        kind: str,
        error: tuple[Any, ...] | None = None,
        body: list[Any] | None = None,
        notes: list[Any] | None = None,
    ) -> Claim:
        return Claim(kind, self.shown, self.digest, self.mode, error, body, notes or None)

    @functools.cached_property
    def channel(self) -> Channel:
        """How this rank's claims and verdicts travel: the store unless :meth:`decide` chose the mailboxes
        (an attribute once read or chosen: no call on the round's path)."""
        return self.store_channel()

    def store_channel(self) -> StoreChannel:
        """Claims and verdicts through the store."""
        return StoreChannel(self.call, self.first, self.seconds, stand_in=stand_in, taken=self.taken)

    def taken(self) -> bytes:
        """What replaces a claim whose inline payload the first rank has taken (a store round's)."""
        return Claim("taken", self.shown, self.digest, self.mode, None).pack()

    def decide(self, error: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        """A participant: take the direct round (claims and verdicts through the ranks' mailboxes) when
        every rank of the list runs on this host, in this pid and network namespace, and the transport is
        this host's. Every participant decides alike (from the same facts); ranks that asked for another
        transport are told by the records. Returns ``error`` (this rank's so far), or else the error of
        deciding (the store, where the ranks posted where they run, is gone: the store round is left)."""
        try:
            if self.request.direct and self.companion.direct(self.ranks, self.seconds, self.what):
                self.channel = MailboxChannel(
                    self.call, self.ranks, self.seconds, self.store_channel, ATTACHED_MAX_BYTES
                )
        except PeerLostError as exc:
            return error or error_of(exc)
        return error

    def record(self, kind: str, error: tuple[Any, ...] | None = None) -> None:
        """Post this rank's part in this call (and its error), read by partners of a direct round past
        the grace (a claim without its body, and the round it takes)."""
        self.call.record([kind, self.shown, self.digest, self.mode, error, self.channel.path])

    def check_claim(self, rank: int, claim: Claim) -> None:
        """Raise when ``rank`` is not a sender of this very gather, or brings an error."""
        if claim.digest != self.digest:
            raise mismatch(self.me, self.shown, rank, claim.ranks)
        if claim.kind != "send":
            raise ArgumentError(f"rank {rank} passed ranks={claim.ranks} but does not send in it")
        if claim.error is not None:
            raise_from(claim.error, f"rank {rank} cannot take part in the gather: ")
        if claim.mode != self.mode:
            raise modes_differ(self.me, self.mode, rank, claim.mode)

    def _workspace_now(self) -> Carrier:
        return self.workspace

    def receiving(self) -> carriers.Receiving:
        """The receiving side's carriers (made on the first fetch, or before the claims come where each is
        fetched as it comes; once ``pin_maps`` and ``_ipc_to`` are set; kept for the call)."""
        if self._receiving is not None:
            return self._receiving
        pg = self.group if self.group is None or isinstance(self.group, dist.ProcessGroup) else None
        self._receiving = carriers.Receiving(
            Context(
                self.first,
                self.seconds,
                pg,
                self._workspace_now if self.workspace_path is not None else None,
                self.pin_maps,
                self._ipc_to,
                self._attached_in,
            )
        )
        return self._receiving

    def fetch(self, rank: int, body: list[Any] | None) -> Any:
        """The buffer of ``rank``'s payload, from the carrier that carried it."""
        if type(body) is not list or len(body) != 2 or type(body[0]) is not str:
            raise PayloadError(f"rank {rank} posted a malformed claim body {body!r:.80}")
        receiving = self._receiving or self.receiving()  # (made once per call: no call per fetch)
        return receiving.fetch(body[0], rank, body[1])

    def discard(self, rank: int, body: list[Any] | None) -> None:
        """Remove what ``rank`` published for us and we did not take (a dead peer cannot)."""
        if not body:
            return
        try:
            token, receipt = body
            self.receiving().discard(token, rank, receipt)
        except Exception as exc:
            logger.warning("%s: could not remove what rank %d published: %s", self.what, rank, exc)

    def notes_for(self, ranks: Sequence[int]) -> list[Any]:
        """The carriers' word (this rank's: :data:`carriers.reports`) for the other processes of ``ranks`` in its pid namespace.
        Its reports name processes; their rank numbers are looked up in the current incarnation (a number
        may have been another process's when the report was made): from the infos this rank has read
        (a first rank's participants), else from this host's ranks (a leader's members, refreshed at most
        twice a second); none is read for the whole list. Ranks not found yet are left for a later gather."""
        directory = self.companion.directory
        if directory is None or not carriers.reports.pending():
            return []
        wanted = self.listed.members if ranks is self.ranks else set(ranks)
        me, watch = self.me, directory.me.can_watch
        # The infos read already (no store operation); past them, this host's (a leader's members).
        found = {r: i for r, i in directory.known().items() if r in wanted}
        pids = {i.pid: r for r, i in found.items() if r != me and watch(i)}
        self._notes_taken = carriers.reports.take(pids)
        if carriers.reports.pending():
            local = {r: i for r, i in directory.local_peers().items() if r in wanted and r not in found}
            self._notes_taken += carriers.reports.take({i.pid: r for r, i in local.items() if watch(i)})
        return self._notes_taken

    def take_back_notes(self) -> None:
        """The gather failed and said so: its verdict carried no notes, so this rank keeps the notes it
        took for a later gather. Every note is delivered once: a second report of a segment written
        again since would let its sender overwrite what a receiver maps. (A rank that never reads the
        verdict keeps nothing back: the first rank may have delivered them; those segments stay busy.)"""
        carriers.reports.keep(self._notes_taken)
        self._notes_taken = []
