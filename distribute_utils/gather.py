"""Gather configs and tensors to the first rank of a group: the toolkit's public heart.

``get_tensors_parallel`` / ``get_configs_parallel`` keep the names and call shapes of
NVIDIA ModelOpt's helpers (``modelopt.torch.export.distribute``), so switching is a change of
import; ``gather_tensors`` / ``gather_configs`` take a :class:`ProcessGroupMesh` and an axis.

Contract (ModelOpt's): every rank of ``group`` (the world when None) enters the call; ``group``
only says who synchronises, ``ranks`` says where *this rank's* value goes. Different ranks may
pass different lists as long as lists are identical or disjoint: every rank named in a list
passes that same list. Each list is its own gather to its own ``ranks[0]``, and all of them
proceed at once. A rank its list does not name only checks in and returns ``[]``.

One call (:class:`distribute_utils.sync.Call`), one hop each way:

1. a sender encodes its value and publishes it through a carrier (see
   :mod:`distribute_utils.transports.base`): within a host the one :class:`~.transports.host.HostRoute`
   picks (inside the claim when small, else shared memory), across hosts the workspace or a collective;
   then sends its claim (list digest, transport, local error, ``[token, receipt]``) and waits
   for one answer: its first rank's verdict.
2. the first rank reads only its own participants' claims, checks that they name the same list
   and transport and carry no error, fetches each payload from the carrier its receipt names
   (:class:`~.transports.carriers.Receiving`; the receipt stays unread), decodes it (zero-copy; in a
   direct round as each claim comes, so that only the last one's payload is left when it comes), and
   sends its verdict (with the carriers' notes for its senders, :data:`~.transports.carriers.reports`).
   Any disagreement or error ends up in the verdict, so every rank of that gather raises, and nobody
   waits for a rank that will not come.
3. a sender releases what it published as soon as it has the verdict.

Claims and verdicts travel through a channel (:mod:`distribute_utils.channel`), one of two, chosen
alike by every participant from where the list's ranks run (:meth:`_Gather.decide`; a sender reads
its first rank's info for it, the first rank its participants'):

- **direct round** (every rank of the list on this host, in one pid and network namespace,
  transport ``auto`` or ``shm``): through the ranks' mailboxes (:mod:`distribute_utils.mailbox`),
  nothing in the store; payloads up to 288 KiB inside the claim. A rank waiting past the grace
  checks its partners' pids and asks them what they do in this call; each rank remembers its
  part (:meth:`_Gather.record`) and answers from a thread of its own, so a rank that does
  something else (another list, another transport) is named within a fraction of a second.
- **store round** (otherwise): keys in the group's namespace. A sender posts its claim
  ``c/<rank>`` and a marker ``v/<rank>`` (so that a rank that wrongly takes it for its receiver
  hears why at once) and waits for ``v/<first>``; the first rank posts its own claim ``c/<first>``
  and its verdict ``v/<first>``. A rank of a direct round that fails posts the same keys, so that
  a partner that went through the store hears it there.

Senders on another host than the first rank wait for its plan (``plan``): the first
participant on each remote host collects its host's payloads and forwards one bundle.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import logging
import secrets
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from os import PathLike
from typing import Any, NamedTuple, NoReturn, ParamSpec, TypedDict, TypeVar

import msgpack
import torch
import torch.distributed as dist

from . import sync, wire
from .caches import Recent
from .channel import Buffer, Channel, MailboxChannel, StoreChannel
from .errors import (
    ArgumentError,
    DeviceUnavailableError,
    GatherError,
    PayloadError,
    PeerLostError,
    TransportUnavailableError,
    UnsupportedTypeError,
)
from .mesh import ProcessGroupMesh
from .processes import process_alive
from .transports import CollectiveTransport, carriers
from .transports.base import Carrier, Context, Route
from .transports.collective import message_device
from .transports.host import INLINE_MAX_BYTES, HostRoute
from .transports.inline import AttachedCarrier
from .transports.shm import release_shared_memory

__all__ = [
    "ATTACHED_MAX_BYTES",
    "INLINE_MAX_BYTES",
    "TRANSPORTS",
    "gather_configs",
    "gather_on",
    "gather_tensors",
    "gather_to_first",
    "get_configs_parallel",
    "get_tensors_parallel",
]

logger = logging.getLogger(__name__)
sync.on_new_incarnation(release_shared_memory)  # nothing kept warm past a process group

TRANSPORTS = ("auto", "shm", "workspace", "collective")
ATTACHED_MAX_BYTES = 288 * 2**10
"""In a direct round, payloads up to this size travel in the claim's message (no file; copied once by
the receiving process, not at all by the sender's); larger ones as :data:`INLINE_MAX_BYTES` says."""


_RAISABLE: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        TypeError,
        ValueError,
        ArgumentError,
        UnsupportedTypeError,
        TransportUnavailableError,
        PeerLostError,
        DeviceUnavailableError,
    )
}


class _List:
    """A checked ranks list, and what every gather call with it shares: its digest, how messages
    show it, and the packed messages that come back call after call (:meth:`kept`). Made once per
    list and group (:func:`_checked`); nothing else of it changes."""

    __slots__ = ("_kept", "digest", "first", "members", "ranks", "shown", "what")

    def __init__(self, ranks: list[int], digest: str) -> None:
        self.ranks, self.first, self.digest = ranks, ranks[0], digest
        self.members = frozenset(ranks)
        self.shown = ranks if len(ranks) <= 64 else None  # (in messages: a long list is left out)
        self.what = f"gather to rank {self.first}"
        self._kept: Recent[tuple[Any, ...], bytes] = Recent(256)

    def kept(self, key: tuple[Any, ...], make: Callable[[], bytes]) -> bytes:
        """``make()``, kept under ``key`` (a message of this list: what it says besides the list)."""
        return self._kept.make(key, make)


def _checked(ranks: Sequence[int], companion: sync.GroupSync, world: int | None) -> _List:
    """``ranks`` checked against the world (``world`` ranks; None: the default group's) and the members
    of ``companion``'s group (raises ValueError).

    The same lists come back call after call: a list checked once is kept (by value, with its group's
    members: a list of members is in the world).
    """
    if (type(ranks) is list or type(ranks) is tuple) and set(map(type, ranks)) == {int}:
        key = (tuple(ranks), companion.ranks)
        found = _LISTS.get(key)
        if found is None:
            checked = _check_ranks_now(ranks, companion.ranks, world or dist.get_world_size())
            found = _LISTS.put(key, _List(checked, companion.digest(checked)))
        return found
    checked = _check_ranks_now(ranks, companion.ranks, world or dist.get_world_size())
    return _List(checked, companion.digest(checked))


_LISTS: Recent[tuple[tuple[int, ...], tuple[int, ...]], _List] = Recent(256)


def _check_ranks_now(ranks: Sequence[int], members: tuple[int, ...], world: int) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise ArgumentError(f"ranks must be a list of global ranks; got {type(ranks).__name__}")
    ranks = list(ranks)
    if not ranks:
        raise ArgumentError("ranks is empty; list the participating global ranks, the receiver first")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise ArgumentError(f"ranks must be ints; got {bad!r} in {ranks}")
    if len(set(ranks)) != len(ranks):
        duplicates = sorted(r for r, n in collections.Counter(ranks).items() if n > 1)
        raise ArgumentError(f"ranks {ranks} lists {duplicates} more than once; each rank may appear once")
    outside_world = [r for r in ranks if not 0 <= r < world]
    if outside_world:
        raise ArgumentError(f"ranks {outside_world} are outside the world (valid: 0..{world - 1})")
    member_set = set(members) if len(members) != world else None
    outside_group = [] if member_set is None else [r for r in ranks if r not in member_set]
    if outside_group:
        raise ArgumentError(
            f"ranks {outside_group} are not in the group {_short(members)}; list members only"
        )
    return ranks


def _short(ranks: Sequence[int]) -> str:
    return sync.short(ranks)


# -- what ranks post -------------------------------------------------------------------------------
class _Claim(NamedTuple):
    """What one rank posts at the start of a gather call (key ``c/<rank>``).

    ``kind`` is "first" (it receives), "send" (``body`` is ``[token, receipt]``: where its
    payload is, in the words of the transport that carried it) or "none"
    (its own list does not name it: it only checks in). Ranks that do not receive also post a
    :class:`_Verdict` marker under ``v/<rank>``, so that a rank that wrongly takes them for its
    receiver hears why at once instead of waiting. ``notes`` are the carriers' word for other
    senders of this gather that this rank holds (a leader let their segments go): the first rank
    passes them on in its verdict.
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
    def unpack(cls, data: bytes | bytearray | memoryview) -> _Claim:
        return cls._make(msgpack.unpackb(data))  # raises TypeError when the fields do not match


class _Verdict(NamedTuple):
    """What a rank posts under ``v/<rank>``: a receiver's verdict, or a non-receiver's marker."""

    receiver: bool
    ranks: list[int] | None
    digest: str
    error: Sequence[Any] | None = None  # the receiver failed: as in a claim
    notes: Sequence[Any] = ()  # the carriers' word to its senders (carriers.reports)

    def pack(self) -> bytes:
        return msgpack.packb(self)  # an array of the fields, in order

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> _Verdict:
        return cls._make(msgpack.unpackb(data))  # raises TypeError when the fields do not match


def _error_of(exc: BaseException) -> tuple[Any, ...]:
    """An error as it travels to other ranks: type name, message, and the ranks it names."""
    missing = list(getattr(exc, "missing", ()) or ())
    return (
        (type(exc).__name__, str(exc)[:4096], missing) if missing else (type(exc).__name__, str(exc)[:4096])
    )


def _raise_from(error: Sequence[Any], prefix: str) -> NoReturn:
    """Raise an error another rank posted: as its own type when it is one of ours to raise,
    else as :class:`GatherError` naming the type."""
    kind, message = error[0], error[1]
    exc_type = _RAISABLE.get(kind)
    if exc_type is None:
        prefix = prefix.replace("cannot take part in the gather: ", "failed: ")
        raise GatherError(f"{prefix}{kind}: {message}" if prefix else f"{kind}: {message}")
    if exc_type is PeerLostError:
        raise PeerLostError(f"{prefix}{message}", error[2] if len(error) > 2 else ())
    raise exc_type(f"{prefix}{message}")


def _mismatch(me: int, mine: list[int] | None, other: int, theirs: list[int] | None) -> ArgumentError:
    return ArgumentError(
        f"ranks disagree on a gather: rank {me} passed ranks={mine}, but rank {other}, which it names, "
        f"passed ranks={theirs}; every rank named in a list must pass that same list (lists may differ "
        "between ranks only when they share no rank)"
    )


def _modes_differ(me: int, mine: str, other: int, theirs: str) -> ArgumentError:
    return ArgumentError(
        f"ranks asked for different transports: rank {me} {mine!r}, rank {other} "
        f"{theirs!r} (transport:has-workspace); pass the same everywhere"
    )


def _not_direct(me: int, other: int) -> ArgumentError:
    return ArgumentError(
        f"rank {other} takes part in this gather through the store while rank {me} sends through "
        "this host's sockets (distribute_utils.mailbox): it could not listen for direct messages "
        "(see its log), or the ranks asked for different transports; pass the same everywhere"
    )


@dataclass(frozen=True)
class _Plan:
    """Who sends to whom in one gather; the first rank works it out and tells remote senders.

    Participants on the first rank's host send to it through shared memory (or inside their
    claim, when small). On every other host, the first participant leads: its host's other
    participants send to it, and it forwards one bundle for the whole host over the
    cross-host transport. Forced ``workspace`` / ``collective`` transports make every sender
    its own leader (flat: no shared-memory hop).
    """

    ranks: tuple[int, ...]
    cross: str | None  # "workspace" | "collective" | None (everyone on one host)
    hosts: dict[int, list[int]]  # leader -> participants on its host, leader first

    @property
    def first(self) -> int:
        return self.ranks[0]

    @property
    def remote(self) -> bool:
        """Some participant is on another host (it needs this plan to know its route)."""
        return (
            len(self.hosts) > 1 and self.cross is not None and len(self.hosts[self.first]) < len(self.ranks)
        )

    def leader_of(self, rank: int) -> int:
        return next(leader for leader, host in self.hosts.items() if rank in host)

    @functools.cached_property
    def direct(self) -> list[int]:
        """Who sends straight to the first rank: its own host's senders and every remote host's
        leader, in ``ranks`` order."""
        senders = {r for r in self.hosts if r != self.first} | set(self.hosts[self.first][1:])
        return [r for r in self.ranks if r in senders]

    @functools.cached_property
    def description(self) -> str:
        """The route in words, for messages ("shm", "workspace", ...)."""
        if self.cross is None:
            return "shm"
        remote = [h for leader, h in self.hosts.items() if leader != self.first]
        if all(len(h) == 1 for h in remote) and len(self.hosts[self.first]) == 1:
            return self.cross
        return f"shm within hosts + {self.cross} across {len(remote)} remote host(s)"

    def pack(self) -> bytes:
        return msgpack.packb([list(self.ranks), self.cross, [[k, v] for k, v in self.hosts.items()]])

    @classmethod
    def unpack(cls, data: bytes) -> _Plan:
        ranks, cross, hosts = msgpack.unpackb(data)
        return cls(tuple(ranks), cross, {k: v for k, v in hosts})


def _plan(requested: str, ranks: list[int], domains: dict[int, str], has_workspace: bool) -> _Plan:
    """Choose the route of every payload (raises before the first rank reads anything)."""
    first, order = ranks[0], tuple(ranks)
    if requested in ("workspace", "collective"):
        if requested == "workspace" and not has_workspace:
            raise ArgumentError(
                "transport='workspace' needs a workspace_path (a directory every rank can reach)"
            )
        return _Plan(order, requested, {r: [r] for r in ranks})
    by_domain: dict[str, list[int]] = {}
    for r in ranks:
        by_domain.setdefault(domains[r], []).append(r)
    if len(by_domain) == 1:
        return _Plan(order, None, {first: list(ranks)})
    if requested == "shm":
        raise TransportUnavailableError(
            f"transport='shm' needs every participant on one host with one /dev/shm, but ranks {ranks} "
            f"span {len(by_domain)} shared-memory domains; use transport='auto'"
        )
    return _Plan(order, "workspace" if has_workspace else "collective", {h[0]: h for h in by_domain.values()})


_CPU = torch.device("cpu")


# -- one gather call on one rank ------------------------------------------------------------------------
class _Gather:
    """One rank's part in one gather call (see the module doc for the protocol)."""

    def __init__(
        self,
        companion: sync.GroupSync,
        call: sync.Call,
        listed: _List,
        *,
        transport: str,
        workspace_path: str | PathLike[str] | None,
        seconds: float,
        group: dist.ProcessGroup | Sequence[int] | None,
        root: str,
    ) -> None:
        self.companion, self.call, self.listed, self.ranks = companion, call, listed, listed.ranks
        self.me, self.first = companion.rank, listed.first
        self.digest, self.shown = listed.digest, listed.shown
        self.transport, self.workspace_path = transport, workspace_path
        self.mode = f"{transport}:{workspace_path is not None}"
        self.seconds, self.group, self.root = seconds, group, root
        self.what = listed.what
        self._collective: dict[str, CollectiveTransport] = {}
        self._attached_in: dict[int, memoryview] = {}  # the first rank's: each sender's, as it came
        self._relayed: list[Any] = []  # a leader: its members' notes, for the first rank's verdict
        self._notes_taken: list[Any] = []  # this rank's own notes, posted in its claim or verdict

    # State that most calls never change (class defaults: nothing to set up per call).
    _workspace: Carrier | None = None
    _sent: carriers.Sent | None = None  # a sender's publication, until released
    _attached: wire.EncodedPayload | None = None  # a direct sender's payload, in its claim message
    _receiving: carriers.Receiving | None = None
    _deferred: tuple[str, wire.EncodedPayload] | None = None  # a collective send awaiting "go"
    _go_posted = False
    _cross: str | None = None
    received_on: str | None = None  # with device=None: where received config tensors go (see gather_to_first)
    cuda_wanted = False  # a sender: its first rank likely wants tensors on a GPU (see _wants_cuda)
    _ipc_to: torch.device | None = None  # the first rank: the GPU it decodes to, where CUDA IPC copies to
    pin_maps = False  # the first rank copies what it receives to a GPU (see receive)
    _channel: Channel | None = None  # how claims and verdicts travel (see decide)

    # -- shared helpers ------------------------------------------------------------------------
    @property
    def workspace(self) -> Carrier:
        """The workspace carrier of the job (made on first use; sweeps dead jobs' leftovers)."""
        if self._workspace is None:
            from .transports.namespace import job_token
            from .transports.workspace import WorkspaceTransport

            if self.workspace_path is None:
                raise ArgumentError("this gather needs a workspace_path (a directory every rank can reach)")
            self._workspace = WorkspaceTransport(
                self.workspace_path, job_token(), self.seconds, sweep_stale=True
            )
        return self._workspace

    def collective(self, device: str) -> CollectiveTransport:
        found = self._collective.get(device)
        if found is None:
            pg = self.group if self.group is None or isinstance(self.group, dist.ProcessGroup) else None
            found = self._collective[device] = CollectiveTransport(
                pg, self.first, self.seconds, torch.device(device)
            )
        return found

    def claim(
        self,
        kind: str,
        error: tuple[Any, ...] | None = None,
        body: list[Any] | None = None,
        notes: list[Any] | None = None,
    ) -> _Claim:
        return _Claim(kind, self.shown, self.digest, self.mode, error, body, notes or None)

    def marker(self) -> bytes:
        return self.listed.kept(("marker",), lambda: _Verdict(False, self.shown, self.digest).pack())

    def success(self) -> bytes:
        """The first rank's verdict when all went well and it has no notes to pass on."""
        return self.listed.kept(
            ("success",), lambda: _Verdict(True, self.shown, self.digest, None, []).pack()
        )

    @property
    def channel(self) -> Channel:
        """How this rank's claims and verdicts travel: the store unless :meth:`decide` chose the mailboxes."""
        if self._channel is None:
            self._channel = self.store_channel()
        return self._channel

    def store_channel(self, receiver: bool | None = None) -> StoreChannel:
        """Claims and verdicts through the store (``receiver``: whether this rank receives, by default
        whether it is its list's first rank)."""
        return StoreChannel(
            self.call,
            self.first,
            self.seconds,
            receiver=self.me == self.first if receiver is None else receiver,
            marker=self.marker,
            taken=self.taken,
        )

    def taken(self) -> bytes:
        """What replaces a claim whose inline payload the first rank has taken (a store round's)."""
        return _Claim("taken", None, self.digest, self.mode, None).pack()

    def decide(self) -> None:
        """A participant: take the direct round (claims and verdicts through the ranks' mailboxes) when
        every rank of the list runs on this host, in this pid and network namespace, and the transport is
        this host's. Every participant decides alike (from the same facts); ranks that asked for another
        transport are told by the records."""
        if self.transport in ("auto", "shm") and self.companion.direct(self.ranks, self.seconds, self.what):
            self._channel = MailboxChannel(
                self.call, self.ranks, self.seconds, self.store_channel, ATTACHED_MAX_BYTES
            )

    def record(self, kind: str, error: tuple[Any, ...] | None = None) -> None:
        """Post this rank's part in this call (and its error), read by partners of a direct round past
        the grace (a claim without its body, and the round it takes)."""
        self.call.record([kind, self.shown, self.digest, self.mode, error, self.channel.path])

    def judge_sender(self, rank: int, entry: list[Any] | str | None) -> bool:
        """The first rank of a direct round, on a sender whose claim has not come: is it in this
        call (True), not yet (False), or doing something else (raises)?"""
        if entry is None:
            return False
        if isinstance(entry, str):  # "past"
            raise _mismatch(self.me, self.shown, rank, None)
        kind, ranks, digest, mode, error, path = entry
        self.check_claim(rank, _Claim(kind, ranks, digest, mode, error))
        if path != "direct":
            raise _not_direct(self.me, rank)
        return True

    def judge_first(self, rank: int, entry: list[Any] | str | None) -> bool:
        """A sender of a direct round, on its first rank whose verdict has not come (see judge_sender)."""
        if entry is None:
            return False
        if isinstance(entry, str) or entry[0] != "first" or entry[2] != self.digest:  # str: "past"
            raise _mismatch(self.me, self.shown, rank, None if isinstance(entry, str) else entry[1])
        mode, error, path = entry[3:]
        if error is not None:
            _raise_from(error, f"the first rank ({rank}) failed: ")
        if mode != self.mode:
            raise _modes_differ(self.me, self.mode, rank, mode)
        if path != "direct":
            raise _not_direct(self.me, rank)
        return True

    def check_claim(self, rank: int, claim: _Claim) -> None:
        """Raise when ``rank`` is not a sender of this very gather, or brings an error."""
        if claim.digest != self.digest:
            raise _mismatch(self.me, self.shown, rank, claim.ranks)
        if claim.kind != "send":
            raise ArgumentError(f"rank {rank} passed ranks={claim.ranks} but does not send in it")
        if claim.error is not None:
            _raise_from(claim.error, f"rank {rank} cannot take part in the gather: ")
        if claim.mode != self.mode:
            raise _modes_differ(self.me, self.mode, rank, claim.mode)

    def plan(self) -> _Plan:
        """The route of this gather, worked out by the first rank from where ranks run (the same lists
        come back call after call: a route is kept for the incarnation, as are the infos it comes from)."""
        routes = self.companion.routes
        key = (tuple(self.ranks), self.transport, self.workspace_path is not None)
        found = routes.get(key)
        if found is None:
            found = routes.put(key, self._plan_now())
        return found

    def _plan_now(self) -> _Plan:
        if self.transport in ("workspace", "collective"):
            return _plan(self.transport, self.ranks, {}, self.workspace_path is not None)
        directory = self.companion.directory
        assert directory is not None
        infos = directory.infos(self.ranks, self.companion.store, self.seconds, self.what)
        domains = {r: i.shm_domain for r, i in zip(self.ranks, infos)}
        return _plan(self.transport, self.ranks, domains, self.workspace_path is not None)

    def my_plan(self) -> _Plan | None:
        """A sender's view: None when it sends straight to the first rank through this host."""
        if self.transport in ("workspace", "collective"):
            return _plan(self.transport, self.ranks, {}, self.workspace_path is not None)
        directory = self.companion.directory
        assert directory is not None
        first = directory.info(self.first, self.companion.store, self.seconds, self.what)
        if first.shm_domain == directory.me.shm_domain:
            return None
        packed = self.call.wait_shared("plan", self.first, 2 * self.seconds, self.what)
        digest, error, plan = msgpack.unpackb(packed)
        if digest != self.digest:
            raise _mismatch(self.me, self.shown, self.first, None)
        if error is not None:
            _raise_from(error, "")
        return _Plan.unpack(plan)

    # -- publishing ------------------------------------------------------------------------------
    def encode(self, value: Any, checksum: bool, keep_device: bool) -> wire.EncodedPayload:
        return wire.encode(value, root=self.root, checksum=checksum, keep_device=keep_device)

    def host(self, receiver: int) -> HostRoute:
        """A sender's route to ``receiver`` (on this host): CUDA IPC first when it is the first rank and
        likely wants tensors on a GPU (``cuda_wanted``); else inline, shared memory, the workspace."""
        directory = self.companion.directory
        assert directory is not None
        info = directory.info(receiver, self.companion.store, self.seconds, self.what)
        pool = directory.me.can_watch(info)
        # A sender may fall back to the workspace when /dev/shm is full, unless told "shm" only.
        fallback = self.workspace_path is not None and self.transport != "shm"
        return HostRoute(
            info,
            pool=pool,
            cuda=self.cuda_wanted and receiver == self.first,
            workspace=self._workspace_now if fallback else None,
            workspace_path=str(self.workspace_path),
            what=self.what,
        )

    def _workspace_now(self) -> Carrier:
        return self.workspace

    @property
    def receiving(self) -> carriers.Receiving:
        """The receiving side's carriers (made on the first fetch, once ``pin_maps`` and ``_ipc_to`` are set)."""
        if self._receiving is None:
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

    def publish_here(self, payload: wire.EncodedPayload) -> list[Any]:
        """A sender on its first rank's host, past the attached sizes: its host route (see :meth:`host`)."""
        return self.publish(self.host(self.first), payload)

    def attach(self, payload: wire.EncodedPayload) -> list[Any]:
        """A direct round's sender: ``payload`` goes in its claim's message (see :data:`ATTACHED_MAX_BYTES`);
        returns the claim body (no token: nothing is named after it, and the claim may be kept)."""
        carrier = AttachedCarrier()
        body = self.publish(carrier, payload, token="")
        self._attached = carrier.outgoing
        return body

    def publish(
        self, carrier: Carrier | Route, payload: wire.EncodedPayload, token: str | None = None
    ) -> list[Any]:
        """Publish this sender's ``payload`` through ``carrier`` (or the one a route picks); returns the
        claim body."""
        token = secrets.token_hex(8) if token is None else token
        self._sent = carriers.publish(carrier, token, self.me, payload)
        return [token, self._sent.receipt]

    def publish_across(self, plan: _Plan, payload: wire.EncodedPayload) -> list[Any]:
        if plan.cross == "workspace":
            return self.publish(self.workspace, payload)
        # A send cannot be taken back: it goes only after the first rank's "go" (see send()).
        device = message_device(self.group, payload.device_resident)
        self._deferred = (device, payload.to_cpu() if device == "cpu" else payload)
        token = secrets.token_hex(8)
        self._sent = carriers.Sent(self.collective(device), token, device, self.me)
        return [token, self._sent.receipt]

    def fetch(self, rank: int, body: list[Any] | None) -> Any:
        """The buffer of ``rank``'s payload, from the carrier that carried it."""
        if type(body) is not list or len(body) != 2 or type(body[0]) is not str:
            raise PayloadError(f"rank {rank} posted a malformed claim body {body!r:.80}")
        return self.receiving.fetch(body[0], rank, body[1])

    def discard(self, rank: int, body: list[Any] | None) -> None:
        """Remove what ``rank`` published for us and we did not take (a dead peer cannot)."""
        if not body:
            return
        try:
            token, receipt = body
            self.receiving.discard(token, rank, receipt)
        except Exception as exc:
            logger.warning("%s: could not remove what rank %d published: %s", self.what, rank, exc)

    def remove_leftovers_of(self, ranks: Sequence[int]) -> None:
        """Senders that died before they could claim may have left a half-published payload (a named
        segment): remove those of dead processes on this host (their tokens were never told)."""
        directory = self.companion.directory
        for rank in ranks:
            info = directory.local_peers().get(rank) if directory is not None else None
            if info is not None and not process_alive(info):
                for path in carriers.remove_left_by(rank, info.pid):
                    logger.info("%s: removed %s, left by rank %d, which died", self.what, path, rank)

    def release(self, taken: bool, answered: bool = False) -> None:
        """Remove what this sender published, once its receiver is done (or gave up: ``taken=False``).
        ``answered``: a verdict came, so the receiver no longer reads (what frees CUDA IPC memory)."""
        if self._sent is not None:
            sent, self._sent = self._sent, None
            sent.release(taken, answered)

    @staticmethod
    def decode(buffer: Any, rank: int, target: torch.device | str | None) -> Any:
        if isinstance(buffer, torch.Tensor) and buffer.device.type != "cpu" and _on_cpu(target):
            buffer = buffer.cpu()  # (a GPU buffer decodes to views there; these tensors go to the CPU)
        try:  # (only configs are decoded to their senders' devices: paths start at "config")
            return wire.decode(buffer, device=target)
        except PayloadError as exc:
            raise PayloadError(f"payload of rank {rank} is unusable: {exc}") from None
        except DeviceUnavailableError as exc:
            raise DeviceUnavailableError(f"rank {rank}'s {exc}") from None

    # -- the roles ---------------------------------------------------------------------------------
    def check_in(self, error: tuple[Any, ...] | None) -> None:
        """A rank its own list does not name: post a claim and a marker, and its record."""
        self._channel = self.store_channel(receiver=False)
        self._channel.post_claim(self.claim("none", error).pack())
        self.record("none", error)

    def send(self, value: Any, error: tuple[Any, ...] | None) -> None:
        """A participant that does not receive: publish, claim, wait for the verdict, release."""
        try:
            if error is None:
                plan = self.my_plan()
                if plan is None:
                    payload = self.encode(value, False, True)  # a GPU's tensors go from there
                    if payload.nbytes <= self.channel.attach_max:
                        body = self.attach(payload)
                    else:
                        body = self.publish_here(payload)
                elif plan.leader_of(self.me) == self.me:
                    body = self.forward(plan, value)
                else:
                    body = self.publish(self.host(plan.leader_of(self.me)), self.encode(value, False, True))
                # What this rank owes the other participants (segments it let go as a receiver or leader;
                # its members' notes). They travel on only in a successful verdict: see take_back_notes.
                notes = self.notes_for(self.ranks) + self._relayed
                if self._attached is not None and not notes:
                    key = ("attached", self.mode, self._attached.nbytes)
                    claim = self.listed.kept(key, lambda: self.claim("send", None, body).pack())
                else:
                    claim = self.claim("send", None, body, notes).pack()
            else:
                claim = self.claim("send", error).pack()
        except BaseException as exc:  # the first rank hears it at once instead of waiting for a claim
            self.take_back_notes()
            with contextlib.suppress(PeerLostError):  # (a store that is gone: this error says more)
                self.channel.give_up(self.claim("send", _error_of(exc)).pack())
            self.record("send", _error_of(exc))
            self.release(taken=False)
            raise
        verdict = self.claim_and_wait(claim, error)
        # A failed gather may never have read this payload: then nobody will report its segment free.
        succeeded = verdict.receiver and verdict.digest == self.digest and verdict.error is None
        self.release(taken=succeeded, answered=verdict.receiver and verdict.digest == self.digest)
        if not succeeded:
            self.take_back_notes()
        if not verdict.receiver or verdict.digest != self.digest:
            raise _mismatch(self.me, self.shown, self.first, verdict.ranks)
        carriers.reports.heed(self.me, verdict.notes)
        if verdict.error is not None:
            _raise_from(verdict.error, f"the first rank ({self.first}) failed: ")

    def claim_and_wait(self, claim: bytes, error: tuple[Any, ...] | None) -> _Verdict:
        """A sender: post its claim (with its payload when it is attached), send a deferred collective
        payload once the first rank says "go", and wait for the verdict. On any failure its partners are
        told what the channel can tell them (its failed claim) and what it published is released."""
        channel = self.channel
        try:
            channel.post_claim(claim, self._attached.buffers() if self._attached is not None else ())
            self.record("send", error)
            if error is not None:
                _raise_from(error, "")
            if self._deferred is not None:
                self.send_deferred()
            found = channel.await_verdict(self.what, self.judge_first)
            if found == self.success():
                return _Verdict(True, self.shown, self.digest)
            return _Verdict.unpack(found)
        except BaseException as exc:
            if not channel.delivered:  # the first rank never had the notes in this claim
                self.take_back_notes()
            error = error or _error_of(exc)
            self.record("send", error)
            with contextlib.suppress(PeerLostError):  # (a store that is gone: this error says more)
                channel.give_up(self.claim("send", error).pack())
            self.release(taken=False)
            raise

    def send_deferred(self) -> None:
        """A collective sender, its claim posted: send its payload once the first rank says "go"."""
        assert self._deferred is not None and self._sent is not None
        device, payload = self._deferred
        self._deferred = None
        go = msgpack.unpackb(self.call.wait_shared("go", self.first, 2 * self.seconds, self.what))
        if go is not None:  # the first rank failed: its verdict will carry no notes
            self.take_back_notes()
            _raise_from(go, f"the first rank ({self.first}) failed: ")
        self.collective(device).publish(self._sent[1], self.me, payload)

    def forward(self, plan: _Plan, value: Any) -> list[Any]:
        """A remote host's leader: collect its host's payloads and send one bundle across."""
        host = plan.hosts[self.me]
        flat = len(host) == 1
        keep_device = flat and plan.cross == "collective" and message_device(self.group, True) != "cpu"
        own = self.encode(value, checksum=flat and plan.cross == "workspace", keep_device=keep_device)
        if flat:
            return self.publish_across(plan, own)
        others = host[1:]
        claims = [_Claim.unpack(c) for c in self.call.wait_for("c", others, self.seconds, self.what)]
        self._relayed = [note for claim in claims for note in claim.notes or ()]
        try:
            for rank, claim in zip(others, claims):
                self.check_claim(rank, claim)
            mine = bytearray(own.nbytes)
            own.write_into(mine)
            parts = [torch.frombuffer(mine, dtype=torch.uint8)]
            for rank, claim in zip(others, claims):
                parts.append(torch.frombuffer(self.fetch(rank, claim.body), dtype=torch.uint8))
        except BaseException:
            for rank, claim in zip(others, claims):
                self.discard(rank, claim.body)
            raise
        bundle = {"ranks": [self.me, *others], "parts": parts}
        payload = wire.encode(bundle, root="bundle", checksum=plan.cross == "workspace")
        return self.publish_across(plan, payload)

    def receive(
        self, own: Any, device: str | torch.device | None, error: tuple[Any, ...] | None
    ) -> list[Any]:
        """The first rank: read its senders' claims, fetch and decode, post the verdict."""
        if error is None:
            own_claim = self.listed.kept(("first", self.mode), lambda: self.claim("first").pack())
        else:
            own_claim = self.claim("first", error).pack()
        self.channel.post_claim(own_claim)
        self.record("first")  # in a direct round, before waiting: a sender past the grace looks for it
        claims: dict[int, _Claim] = {}
        found: dict[int, Any] = {}  # each rank's value (on one host, as its claim comes)
        taken: set[int] = set()  # whose payloads were fetched: nothing of theirs is left to discard
        plan: _Plan | None = None
        try:
            if error is not None:
                _raise_from(error, "")
            decode_to, mine = self.placement(own, device)
            self.pin_maps = decode_to is not None and torch.cuda.is_initialized()
            if isinstance(decode_to, torch.device) and decode_to.type == "cuda":
                self._ipc_to = decode_to
            plan = self.plan_and_tell()
            direct = plan.direct
            # What needs no claim is done before they come: after the last one, only its own part is left.
            found[self.first] = mine()
            notes = self.notes_for(self.ranks[1:])
            self.take_claims(direct, claims, decode_to, found if plan.cross is None else None)
            self.tell_go(None, claims)
            for rank in direct:
                if rank in found:  # decoded as its claim came
                    continue
                value = self.decode(self.fetch(rank, claims[rank].body), rank, decode_to)
                taken.add(rank)
                if rank in plan.hosts and len(plan.hosts[rank]) > 1:
                    for part_rank, part in zip(value["ranks"], value["parts"]):
                        found[part_rank] = self.decode(wire.tensor_buffer(part), part_rank, decode_to)
                else:
                    found[rank] = value
        except BaseException as exc:
            self.tell_go(_error_of(exc), claims)
            failed = _Verdict(True, self.shown, self.digest, _error_of(exc)).pack()
            self.record("first", _error_of(exc))  # (in a direct round, a sender past the grace reads it)
            self.channel.give_up(self.claim("first", _error_of(exc)).pack(), failed)
            self.take_back_notes()
            for rank, claim in claims.items():
                if rank not in taken and rank not in found:  # (found: fetched as its claim came)
                    self.discard(rank, claim.body)
            self.remove_leftovers_of(getattr(exc, "missing", ()))
            raise
        notes += [note for c in claims.values() for note in c.notes or ()]
        # A sender may have received from this rank in an earlier gather (other roles, other numbers).
        carriers.reports.heed(self.me, notes)
        verdict = _Verdict(True, self.shown, self.digest, None, notes).pack() if notes else self.success()
        self.channel.post_verdict(verdict, direct, self.what)
        return [found[r] for r in self.ranks]

    def placement(
        self, own: Any, device: str | torch.device | None
    ) -> tuple[torch.device | str | None, Callable[[], Any]]:
        """The first rank: where received tensors are decoded to (for :func:`wire.decode`), and how its
        own value is yielded. The rule is :func:`gather_to_first`'s."""
        if device is not None:
            target = torch.device(device)
            return (None if target.type == "cpu" else target), lambda: _place_own(own, target, self.root)
        if self.root == "tensor":
            return None, lambda: _place_own(own, _CPU, self.root)
        return (self.received_on or wire.SOURCE_DEVICE), lambda: _place_own(own, None, self.root)

    def take_claims(
        self,
        senders: list[int],
        claims: dict[int, _Claim],
        decode_to: torch.device | str | None,
        found: dict[int, Any] | None,
    ) -> None:
        """The first rank: its senders' claims from the channel, each checked as it comes (into ``claims``,
        so that a failure can discard what came). With ``found`` (every payload on this host: inline,
        attached or in a segment), each payload is fetched and decoded at once too (into ``found``): when
        the last claim comes, only its payload is left to read."""

        def take(rank: int, data: Buffer, attached: memoryview | None) -> None:
            try:
                claim = claims[rank] = _Claim.unpack(data)
            except (ValueError, TypeError) as exc:
                raise PayloadError(f"rank {rank} sent a malformed claim: {exc}") from None
            if attached is not None:
                self._attached_in[rank] = attached
            self.check_claim(rank, claim)
            if found is not None:
                found[rank] = self.decode(self.fetch(rank, claim.body), rank, decode_to)

        self.channel.claims(senders, self.what, self.judge_sender, take)

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

    def tell_go(self, error: tuple[Any, ...] | None, claims: dict[int, _Claim]) -> None:
        """Let collective senders send (or tell them why not); once, only where some may wait."""
        if self._go_posted or (error is None and "collective" not in (self._cross, self.transport)):
            return  # every claim was checked: they all asked for this rank's transport
        # Who sends by collective waits for "go": by this rank's plan, or by its own request.
        waiting = any(
            c.body and (self._cross == "collective" or c.mode.startswith("collective:"))
            for c in claims.values()
        )
        # A failed direct round cannot tell who waits: a sender that asked for the collective may.
        if waiting or (
            error is not None
            and (not self.channel.hears_all or "collective" in (self.transport, self._cross))
        ):
            self.call.post_shared("go", msgpack.packb(list(error) if error else None))
            self._go_posted = True

    def plan_and_tell(self) -> _Plan:
        """Work out the plan; remote senders need it to know their route (posted when they exist)."""
        try:
            plan = self.plan()
        except BaseException as exc:
            if self.transport not in ("workspace", "collective"):
                self.call.post_shared("plan", msgpack.packb([self.digest, list(_error_of(exc)), None]))
            raise
        self._cross = plan.cross
        if plan.remote:
            self.call.post_shared("plan", msgpack.packb([self.digest, None, plan.pack()]))
        self.what = f"gather to rank {self.first} over {plan.description}"
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("round %s: %s", self.call.token, self.what)
        return plan


def _wants_cuda(root: str, device: str | torch.device | None, received_on: str | None) -> bool:
    """A sender's guess, from its own arguments (the first rank's are what count), whether its first rank wants
    received tensors on a GPU: ``device`` a CUDA device, or a config gather restoring senders' devices.
    A wrong guess costs speed only: a GPU buffer bound for the CPU is moved there in ``decode``."""
    if device is None:
        return root == "config" and received_on is None
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError, ValueError):
        return False


def _on_cpu(target: torch.device | str | None) -> bool:
    """Whether :func:`wire.decode` with ``target`` leaves tensors on the CPU (None, or a CPU device)."""
    if target is None:
        return True
    if isinstance(target, str) and target == wire.SOURCE_DEVICE:
        return False
    return torch.device(target).type == "cpu"


def _place_own(value: Any, target: torch.device | None, root: str) -> Any:
    """The first rank's own value with every tensor on ``target``, like every received one
    (ModelOpt's ``tensor.cpu()``); ``target=None`` moves nothing. Containers and dataclasses are copied
    only along the paths to tensors that move; a value with nothing to move comes back as the same object.
    A meta tensor has no data to move: it stays as it is (as a received one decodes).

    Raises:
        TypeError: as :func:`wire.encode` on a sender: containers nested deeper than
            :data:`wire.MAX_DEPTH` or in a reference cycle (the first rank's value is never encoded).
    """
    try:
        return _place(value, target, 0)
    except _TooDeep as deep:
        raise wire.nesting_error(root, deep.path[::-1], deep.containers[::-1]) from None


class _TooDeep(Exception):
    """Raised by :func:`_place` at a container past :data:`wire.MAX_DEPTH`; each container on the way
    back up adds its step (found only now: the walk itself keeps no path)."""

    def __init__(self, container: object) -> None:
        super().__init__()
        self.containers: list[object] = [container]  # the deepest first
        self.path: list[Any] = []  # as wire.nesting_error takes it, the deepest step first

    def step_out(self, parent: object) -> None:
        child = self.containers[-1]
        if isinstance(parent, dict):
            step: Any = next(((k,) for k, v in parent.items() if v is child), ("?",))
        elif isinstance(parent, (list, tuple)):
            step = next((i for i, v in enumerate(parent) if v is child), "?")
        else:
            names = (f.name for f in dataclasses.fields(parent))  # type: ignore[arg-type]
            step = next((n for n in names if getattr(parent, n, None) is child), "?")
        self.path.append(step)
        self.containers.append(parent)


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _place(value: Any, target: torch.device | None, depth: int) -> Any:
    """:func:`_place_own` below ``depth`` containers (raises :class:`_TooDeep` past the limit)."""
    if isinstance(value, torch.Tensor):
        if target is None or (target is _CPU and value.is_cpu) or value.is_meta:
            return value
        return value.detach().to(target) if value.device != target else value
    sequence = isinstance(value, (list, tuple))
    if not (sequence or isinstance(value, dict) or _is_dataclass_instance(value)):
        return value
    if depth >= wire.MAX_DEPTH:
        raise _TooDeep(value)
    depth += 1
    try:
        if sequence:
            items = [_place(v, target, depth) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)(items) if type(value) in (list, tuple) else type(value)(*items)
        if isinstance(value, dict):
            placed = {k: _place(v, target, depth) for k, v in value.items()}
            if all(placed[k] is v for k, v in value.items()):
                return value
            out = copy.copy(value)
            out.update(placed)
            return out
        changed = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name, None)
            new = _place(old, target, depth)
            if new is not old:
                changed[f.name] = new
        if not changed:
            return value
        out = copy.copy(value)
        for name, new in changed.items():
            object.__setattr__(out, name, new)
        return out
    except _TooDeep as deep:
        deep.step_out(value)
        raise


_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Entered(AbstractContextManager):  # type: ignore[type-arg]
    """A call that runs when entered and yields its result (nothing to undo on exit)."""

    __slots__ = ("_args", "_fn", "_kwargs")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._fn, self._args, self._kwargs = fn, args, kwargs

    def __enter__(self) -> Any:
        return self._fn(*self._args, **self._kwargs)

    def __exit__(self, *exc: object) -> None:
        return None


def _runs_when_entered(fn: Callable[_P, _R]) -> Callable[_P, AbstractContextManager[_R]]:
    """``contextlib.contextmanager`` for a function with nothing to undo: no generator to drive."""

    @functools.wraps(fn)
    def entered(*args: _P.args, **kwargs: _P.kwargs) -> AbstractContextManager[_R]:
        return _Entered(fn, args, kwargs)

    return entered


@_runs_when_entered
def gather_to_first(
    value: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | Sequence[int] | None,
    *,
    transport: str,
    workspace_path: str | PathLike[str] | None,
    timeout: float | timedelta | None,
    device: str | torch.device | None,
    root: str,
    received_on: str | None = None,
) -> list[Any]:
    """The one gather under the public functions (and :mod:`distribute_utils.modelopt`): ``value`` of every
    rank in ``ranks`` to ``ranks[0]``, synchronised over ``group``; yields the list there, ``[]`` elsewhere.

    ``root`` says which public call this is (``"tensor"`` or ``"config"``, for checks and messages).
    Where the tensors go on the first rank (ModelOpt's rule; ``docs/api.md``, "Devices"):

    - ``device`` given: every tensor, its own value's included, on ``device``;
    - else ``root="tensor"``: every tensor on the CPU (ModelOpt's ``tensor.cpu()``);
    - else (configs): its own config as passed (the same object), each received tensor on the device its
      sender had it on (``torch.load``'s restore); ``received_on="cpu"`` puts those on the CPU instead
      (ModelOpt's workspace path, ``map_location="cpu"``). A device the first rank lacks raises
      :class:`~distribute_utils.errors.DeviceUnavailableError` on every rank, before anything is yielded.

    Every rank of ``group`` must enter it (see ``docs/api.md``, "The contract: ``group`` synchronises,
    ``ranks`` routes"); the gather runs when it is entered.
    """
    return gather_on(
        sync.companion(group, _resolved(timeout)[0]),  # (a bad timeout: gather_on raises it on every rank)
        value,
        ranks,
        group=group,
        transport=transport,
        workspace_path=workspace_path,
        timeout=timeout,
        device=device,
        root=root,
        received_on=received_on,
    )


def gather_on(
    companion: sync.GroupSync,
    value: Any,
    ranks: Sequence[int],
    *,
    world_size: int | None = None,
    group: dist.ProcessGroup | Sequence[int] | None = None,
    transport: str = "auto",
    workspace_path: str | PathLike[str] | None = None,
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
    root: str = "config",
    received_on: str | None = None,
) -> list[Any]:
    """One gather call over ``companion``'s ranks, run now: the round under :func:`gather_to_first`, for a
    caller that holds its companion (a :class:`~distribute_utils.sync.GroupSync` made with a peer
    directory). Returns the list on ``ranks[0]``, ``[]`` elsewhere.

    This is the seam ``scripts/bench_sync_scale.py`` drives the real round through: simulated ranks
    (threads, each with its own companion on one ``TCPStore``) without a process group. ``world_size``
    bounds the ranks (None: the default group's); ``group`` matters only to the collective transport.
    Every rank of ``companion.ranks`` must call it, in the same order as its other operations.
    """
    # A local mistake is posted in this rank's claim: its gather partners raise it too, none waits.
    seconds, error = _resolved(timeout)
    with companion.exclusive("a gather"):
        call = companion.new_call(seconds)
        try:
            listed = _checked(ranks, companion, world_size)
        except ValueError as exc:
            # No list to route by: check in, so that nobody waits for this rank, and raise.
            _Gather(
                companion,
                call,
                _List([companion.rank], companion.digest([companion.rank])),
                transport=transport,
                workspace_path=workspace_path,
                seconds=seconds,
                group=group,
                root=root,
            ).check_in(_error_of(exc))
            raise
        if error is None and transport not in TRANSPORTS:
            error = _error_of(ArgumentError(f"unknown transport {transport!r}; valid: {list(TRANSPORTS)}"))
        if error is None and root == "tensor" and not isinstance(value, torch.Tensor):
            error = _error_of(
                UnsupportedTypeError(
                    f"get_tensors_parallel gathers a torch.Tensor; got {type(value).__name__}"
                )
            )
        checked = listed.ranks
        this = _Gather(
            companion,
            call,
            listed,
            transport=transport,
            workspace_path=workspace_path,
            seconds=seconds,
            group=group,
            root=root,
        )
        me = companion.rank
        if me in checked:
            try:
                this.decide()
            except PeerLostError as exc:
                error = error or _error_of(exc)
        if me not in checked:
            this.check_in(error)
            if error is not None:
                _raise_from(error, "")
            result: list[Any] = []
        elif me == checked[0]:
            this.received_on = received_on
            if error is None:
                try:
                    _check_device(device)
                except ValueError as exc:
                    error = _error_of(exc)
            result = this.receive(value, device, error)
        else:
            this.cuda_wanted = transport == "auto" and _wants_cuda(root, device, received_on)
            this.send(value, error)
            result = []
    return result


def _resolved(timeout: float | timedelta | None) -> tuple[float, tuple[Any, ...] | None]:
    """Seconds to wait, and the error of a bad ``timeout`` (then the default is waited)."""
    try:
        return sync.resolve_timeout(timeout), None
    except ValueError as exc:
        return sync.DEFAULT_TIMEOUT_S, _error_of(exc)


def _check_device(device: str | torch.device | None) -> None:
    """Raise ValueError when the first rank cannot place results on ``device``."""
    if device is None:
        return
    try:
        why = wire.unusable_device(device)
    except TypeError as exc:  # (not hashable: not a device either)
        why = str(exc)
    if why is not None:
        raise ArgumentError(
            f"device={device!r} is not usable on the first rank ({why}); pass a device it has, "
            "or None for the CPU"
        )


# -- public API ----------------------------------------------------------------------------------
Workspace = str | PathLike[str] | None


class _Options(TypedDict):
    """The options each public gather passes on to :func:`gather_to_first`."""

    transport: str
    workspace_path: Workspace
    timeout: float | timedelta | None
    device: str | torch.device | None


def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[torch.Tensor]]:
    """Gather ``tensor`` of every rank in ``ranks`` to ``ranks[0]``.

    Must be entered on every rank of ``group`` (the world when None). Ranks of the group not
    in ``ranks`` take part in the synchronisation only.

    Args:
        tensor: this rank's tensor: any dtype, shape, strides or device.
        ranks: participating global ranks; ``ranks[0]`` receives. The same list everywhere.
        group: the group whose ranks synchronise (the world when None).
        workspace_path: a directory every rank can reach (NFS), used between hosts, and on
            one host for a payload that ``/dev/shm`` has no room for (logged as a warning).
        transport: ``"auto"`` (shared memory within a host; between hosts the workspace when
            given, else the collective), ``"shm"``, ``"workspace"`` or ``"collective"``.
        timeout: bound on every wait, in seconds or a timedelta (default
            ``$DISTRIBUTE_UTILS_TIMEOUT`` or 600 s).
        device: where the first rank wants every yielded tensor, its own included (default:
            the CPU, as ModelOpt's ``tensor.cpu()``; a CPU tensor of its own is yielded as passed).

    Yields:
        On ``ranks[0]``: one tensor per entry of ``ranks``, its own first; valid after the
        block. Elsewhere: ``[]``.

    Raises:
        ValueError: bad or disagreeing ``ranks``, unknown transport (on every rank).
        TransportUnavailableError: ``"shm"`` across hosts.
        PeerLostError: a rank did not arrive within ``timeout`` (named).
        SpaceError: no room for a payload in ``/dev/shm`` (and no workspace given) or in the
            workspace.
    """
    options = _Options(transport=transport, workspace_path=workspace_path, timeout=timeout, device=device)
    return gather_to_first(tensor, ranks, group, root="tensor", **options)


def get_configs_parallel(
    config: Any,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None = None,
    workspace_path: Workspace = None,
    *,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[Any]]:
    """Gather ``config`` (a tree of plain values, dataclasses and tensors) to ``ranks[0]``.

    Same contract as :func:`get_tensors_parallel`. Devices, as ModelOpt's (``docs/api.md``, "Devices"):
    with ``device=None`` the first rank's own config is yielded as passed (the same object) and each
    received tensor is on the device its sender had it on, as ``torch.load`` restores it (``cuda:N``
    of the sender, the CPU for a CPU tensor); with ``device`` given, every tensor, its own config's
    included, is on ``device``. A meta tensor stays meta. Unlike ModelOpt, a rank that passes ``None``
    yields ``None`` at its position, so positions always match ``ranks`` (:mod:`distribute_utils.modelopt`
    has ModelOpt's behaviour, for its callers).

    Raises:
        TypeError: a value that cannot travel, named by its path (``config['layers'][3]``),
            on every rank before any rank writes anything.
        DeviceUnavailableError: with ``device=None``, a received tensor's device does not exist on
            the first rank (sender, path and device named), on every rank, before anything is yielded.
    """
    options = _Options(transport=transport, workspace_path=workspace_path, timeout=timeout, device=device)
    return gather_to_first(config, ranks, group, root="config", **options)


def gather_tensors(
    tensor: torch.Tensor,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[torch.Tensor]]:
    """Gather ``tensor`` to the first rank of this rank's group along ``axis`` of ``mesh``.

    Must be entered on every rank of that group; groups along the axis proceed independently.
    Options as in :func:`get_tensors_parallel`.
    """
    ranks = mesh.ranks_along_axis(axis)
    group = mesh.cached_group_along_axis(axis) or ranks
    options = _Options(transport=transport, workspace_path=workspace_path, timeout=timeout, device=device)
    return gather_to_first(tensor, ranks, group, root="tensor", **options)


def gather_configs(
    config: Any,
    mesh: ProcessGroupMesh,
    axis: int | str,
    *,
    workspace_path: Workspace = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    device: str | torch.device | None = None,
) -> AbstractContextManager[list[Any]]:
    """Gather ``config`` to the first rank of this rank's group along ``axis`` of ``mesh``.

    Must be entered on every rank of that group. Options and devices as in :func:`get_configs_parallel`.
    """
    ranks = mesh.ranks_along_axis(axis)
    group = mesh.cached_group_along_axis(axis) or ranks
    options = _Options(transport=transport, workspace_path=workspace_path, timeout=timeout, device=device)
    return gather_to_first(config, ranks, group, root="config", **options)
