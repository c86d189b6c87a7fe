"""Internal. Synchronisation of a set of ranks on the CPU, through the job's rendezvous store.

Every set of ranks gets one :class:`GroupSync`, its CPU companion, made on first use and
cached for the life of the default process group: its own client of the ``TCPStore`` that
``init_process_group`` already runs (so threads gathering on different groups never queue
behind each other), a private namespace and a call counter. It works on any group, NCCL
included, needs no extra process group, and names the ranks that did not arrive.

Every operation costs O(N) store operations for N ranks, never N²:

- a **barrier** is torch's own pattern: each rank posts an arrival key, ``add``\\ s to a counter,
  and the last one to arrive posts the key everybody waits on (one wait per rank); the arrival key
  is the rank's one key for the group's life, overwritten with the barrier's number (nothing to delete);
- a **gather call** (:class:`Call`, driven by :mod:`distribute_utils.gather`): each rank posts
  one *claim*; the first rank of each gather reads only its own participants' claims and
  posts one *verdict*; a sender waits for that one verdict. One hop each way. Ranks of one
  host send claims and verdicts to each other's mailboxes instead (:meth:`Call.send_direct`,
  :meth:`Call.receive_direct`; :mod:`distribute_utils.mailbox`): no store operation at all.
- an **exchange** (all-gather of small values) goes to the group's first rank and back.

Other keys are removed by the rank that posted them once every rank has provably moved on: after
the next barrier of the group (one is added every :data:`COLLECT_EVERY` calls).

State belongs to one *incarnation* of the default process group. When the default group is
destroyed and made again (pytest suites, notebooks, elastic restarts), everything cached is
dropped, and the new incarnation's keys live under a new generation number (each rank counts
its incarnations in the store), so stale keys of an old one are never read.

Dead peers on this host are noticed while waiting: a watchdog thread checks their pids and
posts a tombstone in their place (a direct round's waiter checks them itself), so survivors
fail within a fraction of a second instead of at the timeout. Peers on other hosts are
reported when the timeout expires.

Call order: every operation of a :class:`GroupSync` (``barrier``, ``exchange``, a gather
call) must be entered by every rank of its ranks, in the same order on every rank, from one
thread at a time per group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, cast

import msgpack
import torch.distributed as dist

from .caches import Recent
from .errors import ArgumentError, ConcurrentUseError, NotInitializedError, PeerLostError
from .incarnation import (
    CONNECT_ATTEMPT_S,
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    PeerDirectory,
    digest,
    group_ranks,
    incarnation,
    late,
    new_client,
    require_initialized,
    resolve_timeout,
    short,
    store_lost,
)
from .liveness import GRACE_S, JANITOR, TOMBSTONE, WATCH_INTERVAL_S, StandIn, Watch, exited, wait_watched
from .mailbox import ANSWER, Mailbox, MailboxError, address
from .processes import ProcessInfo, process_alive

__all__ = [
    "COLLECT_EVERY",
    "CONNECT_ATTEMPT_S",
    "DEFAULT_TIMEOUT_S",
    "GRACE_S",
    "RETRY_S",
    "TIMEOUT_ENV",
    "Call",
    "GroupSync",
    "barrier",
    "companion",
    "group_ranks",
    "require_initialized",
    "resolve_timeout",
    "short",
]

logger = logging.getLogger(__name__)

COLLECT_EVERY = 64  # calls between the group-wide barriers after which keys are removed
RETRY_S = 0.002  # how soon an undelivered direct message is sent again within the grace
_RECORDS_KEPT = 256  # calls a rank remembers for inquiries (its latest first): as many as a mailbox keeps for
# later calls, so a rank that failed call after call ahead of its partners still answers for each (see
# channel.MailboxChannel.give_up)


# -- a group's companion -------------------------------------------------------------------------
class Call:
    """One operation of a :class:`GroupSync`: keys ``<ns>/<call>/<tag>[/<rank>]``.

    Gather calls use :meth:`post`, :meth:`wait_for` and :meth:`wait_verdict`; see
    :mod:`distribute_utils.gather` for the protocol.
    """

    __slots__ = ("number", "sync")

    def __init__(self, sync: GroupSync, number: int) -> None:
        self.sync = sync
        self.number = number

    @property
    def token(self) -> str:
        """Names the call in log messages (unique within the job)."""
        return f"{self.sync.token_base}{self.number:x}"

    def key(self, tag: str, rank: int | None = None) -> str:
        base = f"{self.sync.namespace}/{self.number}/{tag}"
        return base if rank is None else f"{base}/{rank}"

    def post(self, values: dict[str, bytes], replace: tuple[str, Sequence[int], bytes] | None = None) -> None:
        """Post this rank's ``values`` (tag -> bytes) in one message; they live until collected.

        ``replace`` (tag, ranks, value) overwrites other ranks' keys in the same message (to drop
        bulky payloads early; they stay their posters' to collect).
        """
        sync = self.sync
        keys = [self.key(tag, sync.rank) for tag in values]
        data = list(values.values())
        if replace is not None and replace[1]:
            tag, ranks, value = replace
            others = [self.key(tag, r) for r in ranks]
            keys_all, data_all = keys + others, data + [value] * len(others)
        else:
            keys_all, data_all = keys, data
        try:
            sync.store.multi_set(keys_all, data_all)  # type: ignore[attr-defined]  # torch's stub lacks Store.multi_set
        except Exception as exc:
            raise store_lost(f"posting to ranks {short(sync.ranks)}", exc, sync.store) from None
        sync.own_keys.extend(keys)

    def post_shared(self, tag: str, value: bytes) -> None:
        """Post a key of the call that is not per rank (e.g. a plan); collected by its poster."""
        key = self.key(tag)
        try:
            self.sync.store.set(key, value)  # type: ignore[arg-type]  # torch's stub: set takes bytes too
        except Exception as exc:
            raise store_lost(f"posting to ranks {short(self.sync.ranks)}", exc, self.sync.store) from None
        self.sync.own_keys.append(key)

    def wait_for(self, tag: str, ranks: Sequence[int], timeout: float, what: str) -> list[bytes]:
        """The ``tag`` values of ``ranks``; a dead local rank or a late one is named."""
        keys = [self.key(tag, r) for r in ranks]
        return self.sync.wait(keys, ranks, timeout, what, dict(zip(ranks, keys)))

    def wait_shared(self, tag: str, owner: int, timeout: float, what: str) -> bytes:
        """A key of the call posted by ``owner`` (see :meth:`post_shared`)."""
        key = self.key(tag)
        return self.sync.wait([key], [owner], timeout, what, {owner: key})[0]

    def wait_verdict(
        self, first: int, timeout: float, what: str, stand_in: Callable[[bytes], bytes | None]
    ) -> bytes:
        """``first``'s ``v`` value. When it is late but has arrived (posted its ``c`` claim), it
        is given a second ``timeout``: its own waits are bounded, so its reason will come.

        A rank that does not receive posts no ``v`` key: ``stand_in(its claim)`` is what stands for it (None
        for a receiver's claim), posted by the watchdog once the wait has lasted a second and ``first``'s
        claim says it does not receive (:class:`~distribute_utils.liveness.StandIn`); this rank then
        collects that key. When ``first`` is named late or dead, its claim is read: a rank that does not
        receive, its process gone once its own gather went well, is named for what it did."""
        key, claim_key = self.key("v", first), self.key("c", first)
        standing = StandIn(claim_key, key, stand_in)
        try:
            value = self.sync.wait([key], [first], timeout, what, {first: key}, standing)[0]
        except PeerLostError as exc:
            claim = self.sync.read(claim_key) if exc.missing == (first,) else None
            if claim is None:
                raise
            made = stand_in(claim)
            if made is not None:
                return made
            value = self.sync.wait([key], [first], timeout, what, {first: key}, standing)[0]
        if standing.posted:
            self.sync.own_keys.append(key)
        return value

    # -- direct rounds: one host, no store hop (see distribute_utils.mailbox) --------------------
    def record(self, entry: list[Any]) -> None:
        """Remember what this rank does in this call (``entry``: its kind, the list of ranks it passed,
        that list's digest, then what its layer likes): a partner of a direct round that waits past the
        grace asks for it (:meth:`receive_direct`), sending its own (see :meth:`GroupSync.compare`). Kept in memory
        for this rank's last :data:`_RECORDS_KEPT` calls of the group; a later entry for the same call
        (a failure) replaces the earlier one."""
        sync = self.sync
        # A ring by call number: one slot set, which the answering thread reads whole (no copy per call).
        sync.records[self.number % _RECORDS_KEPT] = [self.number, *entry]
        if self.number > sync.latest:
            sync.latest = self.number

    def send_direct(
        self, rank: int, kind: int, parts: Sequence[bytes | bytearray | memoryview], timeout: float = 0.0
    ) -> bool:
        """Send one message (``parts``, concatenated) to ``rank``'s mailbox of this group; False when
        it does not listen (yet) or its queue stayed full for ``timeout`` seconds."""
        sync = self.sync
        mailbox = sync._mailbox or sync.mailbox()
        address = sync.addresses[rank]
        return mailbox.send_now(address, self.number, sync.rank, kind, parts) or mailbox.send_to(
            address, self.number, sync.rank, kind, parts, timeout
        )

    def receive_direct(
        self,
        kind: int,
        ranks: Sequence[int],
        timeout: float,
        what: str,
        judge: Callable[[int, list[Any] | str | None], bool],
        arrived: Callable[[int, bytearray], None],
        undelivered: Callable[[], bool] | None = None,
        second_chance: bool = False,
    ) -> None:
        """Wait for one message of ``kind`` of this call from each of ``ranks``, handing each to
        ``arrived(rank, data)`` as it comes (which may raise to end the wait).

        ``undelivered()`` (when given) sends this rank's own message again and says whether it is
        still undelivered: every :data:`RETRY_S` within the grace, then every :data:`WATCH_INTERVAL_S`.
        Within the grace this only listens. Past it, every :data:`WATCH_INTERVAL_S`: a missing rank
        that exited raises; each missing rank is asked what it does in this call
        (:meth:`~distribute_utils.mailbox.Mailbox.inquire`), and ``judge(rank, entry)`` reads its
        answer (its :meth:`record` entry, None when it has not come this far, ``"past"`` when it went
        past this call): it raises when that rank does something else, and returns whether it is in
        this call. At ``timeout`` the missing ranks are reported (late); with ``second_chance`` a
        missing rank that answered that it is in this call is given one more ``timeout``.

        Raises:
            PeerLostError: a rank exited or did not come within the timeout.
        """
        sync = self.sync
        mailbox = sync._mailbox or sync.mailbox()
        infos = sync.infos
        missing = {r: infos[r] for r in ranks}
        there: dict[int, bool] = {}
        start = time.monotonic()
        if undelivered is None:  # within the grace it only listens: the first wait, before the loop's set-up
            self._take(
                mailbox.receive(self.number, missing, min(GRACE_S, timeout)),
                kind,
                missing,
                there,
                judge,
                arrived,
            )
            if not missing:
                return
        deadline = start + timeout
        tick = start + min(GRACE_S, timeout)
        retry = start + RETRY_S if undelivered is not None else float("inf")
        chance = second_chance
        while missing:
            now = time.monotonic()
            if now >= retry:
                assert undelivered is not None
                retry = now + (RETRY_S if now < tick else WATCH_INTERVAL_S) if undelivered() else float("inf")
            if now >= tick:
                # A peer's message comes before its exit, and before its answer that it went past.
                dead = {r: info.pid for r, info in missing.items() if not process_alive(info)}
                self._take(mailbox.receive(self.number, missing, 0.0), kind, missing, there, judge, arrived)
                if any(r in missing for r in dead):
                    raise exited(what, {r: pid for r, pid in dead.items() if r in missing}, sync.store)
                if not missing:
                    break
                if now >= deadline:
                    if not (chance and all(there.get(r, False) for r in missing)):
                        generation, lookup = sync.generation if sync.generation is not None else (None, None)
                        raise late(what, list(missing), timeout, lookup, generation)
                    chance, deadline = False, now + timeout
                mine = sync.entry(self.number)
                for info in missing.values():
                    mailbox.inquire(info, self.number, sync.rank, mine)
                tick = now + WATCH_INTERVAL_S
            wait = max(0.0, min(tick, deadline, retry) - time.monotonic())
            self._take(mailbox.receive(self.number, missing, wait), kind, missing, there, judge, arrived)

    @staticmethod
    def _take(
        messages: list[tuple[int, int, bytearray]],
        kind: int,
        missing: dict[int, ProcessInfo],
        there: dict[int, bool],
        judge: Callable[[int, list[Any] | str | None], bool],
        arrived: Callable[[int, bytearray], None],
    ) -> None:
        for rank, their_kind, data in messages:
            if rank not in missing:
                continue
            if their_kind == kind:
                del missing[rank]
                arrived(rank, data)
            elif their_kind == ANSWER:
                there[rank] = judge(rank, msgpack.unpackb(data)[0])


class GroupSync:
    """The CPU companion of one set of ranks; obtain it with :func:`companion`.

    Args:
        ranks: the global ranks, in group order.
        rank: this process's global rank (one of ``ranks``).
        store: a store client of its own (not shared with other groups or threads).
        namespace: the key prefix of this group in the store.
        peers: where ranks run, for the watchdog (None: dead peers are found at the timeout).
        generation: this rank's generation and a lookup of others' (for messages).
    """

    def __init__(
        self,
        ranks: tuple[int, ...],
        rank: int,
        store: dist.Store,
        namespace: str,
        peers: PeerDirectory | None = None,
        generation: tuple[int, Callable[[int], int | None]] | None = None,
    ) -> None:
        self.ranks = ranks
        self.members = frozenset(ranks)
        self.rank = rank
        self.store = store
        self.namespace = namespace
        self.token_base = digest((namespace, ranks))[:8]
        self.directory = peers
        self.generation = generation
        self._calls = 0
        self._collected = 0  # calls before this number have been collected
        self.own_keys: list[str] = []
        self._busy = threading.Lock()
        self.gathering = _Exclusive(self, "a gather")
        """Holds the group for one gather call (:meth:`exclusive`, made once: entered call after call)."""
        self._digests: Recent[tuple[int, ...], str] = Recent(4096)
        # The gather layer's routes over this group, kept for the incarnation (see roles.FirstRank.plan).
        self.routes: Recent[Any, Any] = Recent(256)
        # Its repeats of calls that went well (roles.repeat), kept for the incarnation.
        self.repeats: Recent[Any, Any] = Recent(64)
        # This rank's latest entries (see Call.record): call number % _RECORDS_KEPT -> [number, *entry].
        self.records: list[list[Any] | None] = [None] * _RECORDS_KEPT
        self.latest = -1  # the newest call recorded
        # A call where a rank named this one in another list (see compare); posted by the next gather.
        self.disagreement: tuple[int, int, str] | None = None  # (call, asker, message)
        self.failed_call = -1  # this rank's latest call that raised
        self.infos: dict[int, ProcessInfo] = {}  # ranks of direct rounds (see direct())
        self.addresses: dict[int, str] = {}  # their mailboxes of this group
        self._direct: Recent[tuple[int, ...], bool] = Recent(4096)
        self._mailbox: Mailbox | None = None
        self._polling_decided = False
        if peers is not None and peers.me.direct_domain is not None:
            # Listening from the start: a peer's first claim then finds it (else it sends again).
            try:
                self.mailbox()
            except MailboxError as exc:  # its first direct round will raise this
                logger.warning("%s", exc)

    def entry(self, number: int) -> list[Any] | str | None:
        """What this rank remembers of call ``number`` (see :meth:`Call.record`; read by the answering
        thread): its entry, ``"past"`` when it is no longer kept, None when not made yet."""
        record = self.records[number % _RECORDS_KEPT]  # (the calling thread sets whole slots only)
        if record is not None and record[0] == number:
            return record[1:]
        if number < self.latest:
            return "past"  # it has gone on, and took no part in that call as a gather (or forgot it)
        return None

    def compare(self, number: int, asker: int, asking: Any, entry: list[Any] | str | None) -> None:
        """The answering thread: rank ``asker`` waits for this rank in call ``number``, where it does
        ``asking`` and this rank did ``entry`` (both :meth:`Call.record` entries). When their lists
        differ (a rank named in a list must pass that same list), this rank says so at once (a
        warning) and its next call of this group raises it: the asker fails that call, and this rank,
        whose own gather may have succeeded, must not go on as if nothing happened (see
        :meth:`take_disagreement`)."""
        if not (isinstance(asking, list) and isinstance(entry, list) and len(asking) > 2 and len(entry) > 2):
            return
        if asking[2] == entry[2] or (
            self.disagreement is not None and self.disagreement[:2] == (number, asker)
        ):
            return
        message = (
            f"ranks disagree on a gather: rank {asker} passed ranks={asking[1]}, which names rank "
            f"{self.rank}, but rank {self.rank} passed ranks={entry[1]} in the same call; every rank named "
            "in a list must pass that same list (lists may differ between ranks only when they share no rank)"
        )
        logger.warning("%s", message)
        self.disagreement = (number, asker, message)

    def take_disagreement(self) -> str | None:
        """The message of a disagreement :meth:`compare` found since the last call (once): the gather
        layer posts it as this rank's error in its next call, so its partners raise it too."""
        found, self.disagreement = self.disagreement, None
        if found is None or found[0] == self.failed_call:
            return None  # (that call failed here: this rank was told then)
        return found[2]

    def direct(self, ranks: Sequence[int], timeout: float, what: str) -> bool:
        """Whether ``ranks`` (this rank among them) run on one host in one pid and network namespace,
        so that a round among them can go through their mailboxes; the same answer on each of them
        (a sender reads O(1) keys for it, the first rank O(len(ranks)): see PeerDirectory.together)."""
        key = tuple(ranks)
        found = self._direct.get(key)
        if found is None:
            found = False
            if self.directory is not None:
                found = self.directory.together(key, self.store, timeout, what)
                if found:  # a sender talks to its first rank only; the first rank to every sender
                    partners = key if self.rank == key[0] else key[:1]
                    for r in partners:
                        info = self.infos[r] = self.directory.info(r, self.store, timeout, what)
                        self.addresses[r] = address(info, self.namespace)
                    if self._mailbox is not None and not self._polling_decided:
                        self._decide_polling(self._mailbox)
            self._direct.put(key, found)
        return found

    def _decide_polling(self, mailbox: Mailbox) -> None:
        """Waits poll before they sleep where this host has a core for each of the job's ranks on it
        (at a group's first direct round, every rank of its list is counted: see on_this_host)."""
        assert self.directory is not None
        self._polling_decided = True
        try:
            here = self.directory.on_this_host(self.store)
        except Exception as exc:  # (polling only saves time: trouble with the store shows in the round)
            logger.debug("could not count the ranks on this host, so waits sleep at once: %s", exc)
            return
        mailbox.poll(here <= len(os.sched_getaffinity(0)))

    def mailbox(self) -> Mailbox:
        """This rank's mailbox of this group (listening from the group's first use here).

        Raises:
            MailboxError: it cannot listen (see :class:`~distribute_utils.mailbox.Mailbox`).
        """
        found = self._mailbox
        if found is None:
            assert self.directory is not None
            found = self._mailbox = Mailbox(self.namespace, self.directory.me)
        return found

    def close(self) -> None:
        """Stop listening (the incarnation ends)."""
        if self._mailbox is not None:
            self._mailbox.close()

    def digest(self, ranks: Sequence[int]) -> str:
        """A short digest of a ranks list (cached: the same lists come back call after call)."""
        key = tuple(ranks)
        found = self._digests.get(key)
        if found is None:
            found = self._digests.put(key, digest(list(key)))
        return found

    # -- calls ---------------------------------------------------------------------------------
    def new_call(self, timeout: float) -> Call:
        """The next call; every rank must make the same calls in the same order.

        Every :data:`COLLECT_EVERY` calls without a barrier, a barrier comes first (as a call of
        its own), after which the keys of earlier calls are removed.
        """
        number = self._calls
        if number - self._collected >= COLLECT_EVERY:
            self._barrier(
                self._next(), timeout, f"a barrier over ranks {short(self.ranks)} (collecting keys)"
            )
            number = self._calls
        self._calls = number + 1
        return Call(self, number)

    def _next(self) -> Call:
        call = Call(self, self._calls)
        self._calls += 1
        return call

    def read(self, key: str) -> bytes | None:
        """``key``'s value, None when it is not there (or the store does not answer)."""
        try:
            return self.store.get(key) if self.store.check([key]) else None
        except Exception:
            return None

    def wait(
        self,
        keys: list[str],
        ranks: Sequence[int],
        timeout: float,
        what: str,
        awaited: dict[int, str] | None,
        stand_in: StandIn | None = None,
    ) -> list[bytes]:
        watch = None
        if self.directory is not None and awaited:
            watch = Watch(self.directory, self.directory.watch_client(timeout), awaited, None, stand_in)
        generation, lookup = self.generation if self.generation is not None else (None, None)
        return wait_watched(self.store, keys, ranks, timeout, what, watch, lookup, generation)

    # -- barrier -------------------------------------------------------------------------------
    def barrier(self, timeout: float, what: str = "barrier") -> None:
        """Return once every rank of ``ranks`` has entered. Must be called on every rank."""
        with self.exclusive(what):
            self._barrier(self._next(), timeout, what)

    def arrival_key(self, rank: int) -> str:
        """The key where ``rank`` says which barrier it last entered: one per rank for the group's life,
        overwritten with the barrier's call number (not one per barrier, which the janitor would then
        delete: N store requests per barrier). Read by :meth:`arrived` only on a barrier's failure path."""
        return f"{self.namespace}/in/{rank}"

    @staticmethod
    def arrived(store: dist.Store, key: str, number: int) -> bool:
        """Whether the rank whose :meth:`arrival_key` is ``key`` has entered barrier ``number`` (or a later
        one: calls only go forward), read through ``store``."""
        if not store.check([key]):
            return False
        return int(store.get(key)) >= number

    def _barrier(self, call: Call, timeout: float, what: str) -> None:
        n = len(self.ranks)
        go, number = call.key("go"), call.number
        try:
            self.store.set(self.arrival_key(self.rank), str(number))
            arrived = self.store.add(call.key("count"), 1)
            if arrived >= n:
                self.store.set(go, b"1")  # type: ignore[arg-type]  # torch's stub: set takes bytes too
        except Exception as exc:
            raise store_lost(what, exc, self.store) from None
        if arrived < n:
            watch = None
            if self.directory is not None:  # (without one, dead peers are found at the timeout)
                watch = Watch(
                    self.directory,
                    self.directory.watch_client(timeout),
                    _Every(self.members, self.rank, go),  # (not a dict of N ranks: O(1) per rank)
                    lambda store, r: self.arrived(store, self.arrival_key(r), number),
                )
            try:
                value = wait_watched(self.store, [go], [-1], timeout, what, watch, tombstones=False)[0]
            except PeerLostError as exc:
                if not exc.missing:  # the store itself is gone: nobody can be named from it
                    raise
                missing = [r for r in self.ranks if r != self.rank and not self._arrived(r, number)]
                if not missing:
                    raise
                generation, lookup = self.generation if self.generation is not None else (None, None)
                raise late(what, missing, timeout, lookup, generation) from None
            if value.startswith(TOMBSTONE):
                dead = int(value[len(TOMBSTONE) :])
                raise PeerLostError(
                    f"{what}: rank(s) [{dead}] exited while ranks {short(self.ranks)} were waiting for them",
                    [dead],
                )
        self._collect(number)

    def _arrived(self, rank: int, number: int) -> bool:
        try:
            return self.arrived(self.store, self.arrival_key(rank), number)
        except Exception:
            return False

    def _collect(self, barrier_number: int) -> None:
        """Every rank has left every call before ``barrier_number``: remove our keys of those."""
        keys, self.own_keys = self.own_keys, []
        if self.rank == self.ranks[0]:
            previous = Call(self, self._collected - 1) if self._collected > 0 else None
            if previous is not None:
                keys += [previous.key("count"), previous.key("go")]
        self._collected = barrier_number + 1 if barrier_number >= 0 else self._collected
        # One janitor client per incarnation, not per group: keyed by the store every group's was cloned from.
        JANITOR.delete(self.directory.store if self.directory is not None else self.store, keys)

    # -- exchange ------------------------------------------------------------------------------
    def _through_first(
        self, value: bytes, timeout: float, what: str, combine: Callable[[list[bytes]], bytes]
    ) -> bytes:
        """Every rank posts ``value``; the group's first rank reads them all and posts
        ``combine(values)``, which every rank returns (O(N) store operations)."""
        with self.exclusive(what):
            call = self.new_call(timeout)
            first = self.ranks[0]
            call.post({"x": value})
            if self.rank == first:
                combined = combine(call.wait_for("x", self.ranks, timeout, what))
                call.post({"all": combined})
                return combined
            return call.wait_for("all", [first], timeout, what)[0]

    def exchange(self, value: bytes, timeout: float, what: str = "exchange") -> list[bytes]:
        """All-gather of one small ``bytes`` per rank, in the order of ``ranks``, through the
        group's first rank. Must be called on every rank of ``ranks``."""
        return msgpack.unpackb(self._through_first(value, timeout, what, msgpack.packb))

    def agree(self, value: bytes, timeout: float, what: str = "agreement") -> tuple[bytes, dict[int, bytes]]:
        """Check that every rank holds the same ``value``: the group's first rank compares and
        posts one verdict (O(N) store operations, O(N) bytes). Must be called on every rank.

        Returns:
            The first rank's value and, for up to three ranks whose value differs, theirs
            (empty when all agree).
        """

        def verdict(values: list[bytes]) -> bytes:
            differing = [[r, v] for r, v in zip(self.ranks, values) if v != values[0]]
            return msgpack.packb([values[0], differing[:3]])

        base, shown = msgpack.unpackb(self._through_first(value, timeout, what, verdict))
        return base, {r: v for r, v in shown}

    def peers(self, timeout: float) -> list[ProcessInfo]:
        """Where every rank of the group runs (one read per rank not looked up before)."""
        if self.directory is None:
            raise NotInitializedError(
                "this companion was made without a peer directory (companion() gives one)"
            )
        return self.directory.infos(self.ranks, self.store, timeout, f"looking up ranks {short(self.ranks)}")

    def exclusive(self, what: str) -> _Exclusive:
        """Hold the group for one operation; a second thread on the same group is refused."""
        return _Exclusive(self, what)


class _Every(Mapping[int, str]):
    """The key every rank of ``members`` but ``me`` awaits (a barrier's watch), without a dict of them."""

    def __init__(self, members: frozenset[int], me: int, key: str) -> None:
        self.members, self.me, self.key = members, me, key

    def __getitem__(self, rank: int) -> str:
        if rank == self.me or rank not in self.members:
            raise KeyError(rank)
        return self.key

    def __iter__(self) -> Iterator[int]:
        return (r for r in self.members if r != self.me)

    def __len__(self) -> int:
        return len(self.members) - 1


class _Exclusive:
    def __init__(self, sync: GroupSync, what: str) -> None:
        self.sync, self.what = sync, what

    def __enter__(self) -> None:
        if not self.sync._busy.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{self.what}: another thread of this rank is inside an operation on ranks "
                f"{short(self.sync.ranks)}; operations on one group must come from one thread at a time "
                "(different groups may be used from different threads)"
            )

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # this rank's latest call failed: it was told (see take_disagreement)
            self.sync.failed_call = self.sync._calls - 1
        self.sync._busy.release()


def companion(ranks: Sequence[int] | dist.ProcessGroup | None, timeout: float | None = None) -> GroupSync:
    """The cached :class:`GroupSync` of ``ranks`` (a rank list, a group, or None for the world); a new
    one connects to the store within ``timeout`` (seconds; None: ``$DISTRIBUTE_UTILS_TIMEOUT`` or the default).

    Raises:
        ArgumentError: (a ``ValueError``) the calling rank is not among ``ranks``.
        PeerLostError: the job's store is gone (found now, or at once when an earlier call found it).
    """
    inc = incarnation(timeout)
    if ranks is None and inc.world is not None:
        return inc.world  # type: ignore[return-value]  # (only GroupSyncs are kept there; no cast call per gather)
    world = ranks is None
    if ranks is None or isinstance(ranks, dist.ProcessGroup):
        ranks = group_ranks(ranks)
    key = tuple(ranks)
    sync = cast("GroupSync | None", inc.companions.get(key))
    if sync is None:
        if inc.rank not in key:
            raise ArgumentError(
                f"rank {inc.rank} is not in group {short(key)}; only its members may synchronise on it"
            )
        with inc.lock:
            sync = cast("GroupSync | None", inc.companions.get(key))
            if sync is None:
                sync = inc.companions[key] = GroupSync(
                    key,
                    inc.rank,
                    new_client(inc.store, f"joining group {short(key)}", timeout),
                    f"{inc.prefix}/{digest(key)}",
                    inc.peers,
                    (inc.generation, inc.generation_of),
                )
                inc.by_namespace[sync.namespace] = sync
    if world:
        inc.world = sync
    return sync


def barrier(
    group: dist.ProcessGroup | Sequence[int] | None = None, timeout: float | timedelta | None = None
) -> None:
    """Barrier over the ranks of ``group`` (the world when None), on the CPU, with a timeout.

    Must be called on every rank of ``group``; other ranks do not take part. Costs one
    arrival key, one counter increment and one wait per rank (torch's store-barrier pattern).

    Raises:
        PeerLostError: (a ``TimeoutError``) naming the ranks that did not arrive in time.
    """
    seconds = resolve_timeout(timeout)
    sync = companion(group, seconds)
    sync.barrier(seconds, what=f"barrier over ranks {short(sync.ranks)}")
