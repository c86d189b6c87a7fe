"""Internal. One incarnation of the default process group: what lives and dies with it.

Everything this package caches for a process group belongs to one :class:`Incarnation`, made on
first use (:func:`incarnation`) and dropped when the default group is destroyed or replaced
(pytest suites, notebooks, elastic restarts): its own client of the job's rendezvous store, the
generation its keys live under (each rank counts its incarnations in the store, so stale keys of
an old one are never read), the :class:`PeerDirectory` (where ranks run), the groups' companions
(:class:`~distribute_utils.sync.GroupSync`, made by :mod:`distribute_utils.sync`) and the memory
that its store is gone. The state modules keep for the group is in its scope
(:meth:`Incarnation.own`, :func:`distribute_utils.owners.owned`: one object per class, closed newest
first when the group goes; :mod:`distribute_utils.owners` lists what is process-wide instead, and
why).

A process forked while its parent had a default group must not use it (its connections are the
parent's): the fork is noted at fork time (by :func:`distribute_utils.owners.after_fork`, part of the
package's one at-fork hook: a fork may come before any call of ours), and :func:`incarnation` refuses
such a child.

This module also holds the store primitives every layer above uses: timeouts, new store clients
made within a timeout (:func:`new_client`), the errors of a store that is slow or gone, and the
plain wait for keys (:func:`wait_values`; the watched wait is :func:`distribute_utils.liveness.wait_watched`).

Call order: :func:`incarnation` from any thread; it is made once per default group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import msgpack
import torch.distributed as dist

from .errors import ArgumentError, ForkedProcessError, NotInitializedError, PeerLostError
from .mailbox import answer_inquiries
from .owners import after_fork, group_scope
from .processes import ProcessInfo, this_process

__all__ = [
    "CONNECT_ATTEMPT_S",
    "DEFAULT_TIMEOUT_S",
    "PROBE_TIMEOUT_S",
    "TIMEOUT_ENV",
    "Incarnation",
    "Member",
    "PeerDirectory",
    "ProcessInfo",
    "digest",
    "group_ranks",
    "incarnation",
    "late",
    "new_client",
    "refusal",
    "require_initialized",
    "resolve_timeout",
    "short",
    "store_gone",
    "store_lost",
    "this_process",
    "wait_values",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "DISTRIBUTE_UTILS_TIMEOUT"
PROBE_TIMEOUT_S = 1.0  # a look whether a store's server still takes connections
# One attempt of a new store client to connect (repeated while the server answers). A dead server is found
# by the look before it (refused at once), so this bounds only a live but slow one: long enough that a
# loaded host does not time out (torch prints each timed-out attempt as an error with a C++ stack).
CONNECT_ATTEMPT_S = 30.0
_ROOT = "distribute_utils"
_DISTRIBUTED = dist.is_available()  # (torch built without it has no dist.group)
_LOCAL_REFRESH_S = 0.5  # how soon a process looks again for the ranks of its host (see local_peers)
_LOCAL_REFRESH_MAX_S = 8.0  # ... at the latest, once its list stopped changing


def resolve_timeout(timeout: float | timedelta | None) -> float:
    """Seconds to wait at most: ``timeout``, else ``$DISTRIBUTE_UTILS_TIMEOUT``, else 600.

    Raises:
        ValueError: a timeout that is not a positive number of seconds.
    """
    source = "timeout"
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV)
        if env is None:
            return DEFAULT_TIMEOUT_S
        source = f"${TIMEOUT_ENV}"
        try:
            timeout = float(env)
        except ValueError:
            raise ArgumentError(f"{source}={env!r} is not a number of seconds") from None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ArgumentError(f"{source} must be a positive number of seconds or a timedelta; got {timeout!r}")
    return float(timeout)


def require_initialized() -> None:
    """Raises :class:`~distribute_utils.errors.NotInitializedError` (a ``RuntimeError``, saying what to
    call) unless a default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise _not_initialized()


def _not_initialized() -> NotInitializedError:
    return NotInitializedError(
        "torch.distributed is not initialised: call torch.distributed.init_process_group() "
        "(or start under torchrun) before using groups, barriers or gathers"
    )


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group`` (the whole world when None), in group-rank order."""
    require_initialized()
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def short(ranks: Sequence[int]) -> str:
    """``ranks`` for a message: in full up to 16, else first, last and count."""
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"


def digest(value: object) -> str:
    """A short digest of ``repr(value)`` (key names, tokens)."""
    return hashlib.blake2b(repr(value).encode(), digest_size=8).hexdigest()


def store_lost(what: str, exc: BaseException, store: dist.Store) -> PeerLostError:
    """The error of an operation on ``store`` that failed with ``exc``: when its server no longer takes
    connections, the store is gone for good (see :func:`store_gone`)."""
    refused = refusal(store)
    # A server killed this instant may still accept while its process exits (its connections can close
    # before its listener does): when the peer closed ours, look again for a moment before saying "lost".
    for _ in range(_CLOSED_PROBES if refused is None and _closed_by_peer(exc) else 0):
        time.sleep(0.1)
        refused = refusal(store)
        if refused is not None:
            break
    if isinstance(refused, ConnectionRefusedError):
        return store_gone(what, store, refused)
    return _lost_contact(what, store, exc)


_CLOSED_PROBES = 10  # (one second at most, only after the store's server closed a connection)


def _closed_by_peer(exc: BaseException) -> bool:
    """Whether ``exc`` says the other end closed the connection (torch's store errors carry only text)."""
    if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
        return True
    text = str(exc).lower()  # e.g. torch's "Failed to recv, got 0 bytes. Connection was likely closed."
    return any(words in text for words in ("broken pipe", "connection reset", "connection was likely closed"))


def _lost_contact(what: str, store: dist.Store, exc: BaseException) -> PeerLostError:
    """``store`` did not serve an operation, but its server was not seen gone (it may be slow, or its host
    unreachable): this call fails, later ones try again."""
    address = _address(store)
    at = f" at {address}" if address else ""
    return PeerLostError(f"{what}: lost contact with the job's rendezvous store{at}: {exc}", ())


def store_gone(
    what: str, store: dist.Store, exc: BaseException | str, missing: tuple[int, ...] | list[int] = ()
) -> PeerLostError:
    """``store``'s server is gone (it ran in the launcher or in a rank, rank 0 for ``env://`` and
    ``mp.spawn`` jobs, that exited): the error, which every later call of this incarnation raises at
    once (see :func:`incarnation`)."""
    error = PeerLostError(
        f"{what}: the job's rendezvous store at {_address(store) or 'its address'} is gone: its server (in "
        f"the launcher, or in the rank that hosts it, rank 0 for env:// and mp.spawn jobs) no longer takes "
        f"connections ({exc or type(exc).__name__}); this process group cannot synchronise any more",
        missing,
    )
    _mark_lost(store, error)
    return error


def _tcp_store(store: dist.Store) -> dist.TCPStore | None:
    """The ``TCPStore`` under ``store`` (maybe under prefix stores); None for other stores."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def _address(store: dist.Store) -> str | None:
    """``host:port`` of ``store``'s server, None when it is not a ``TCPStore``."""
    base = _tcp_store(store)
    return None if base is None else f"{base.host}:{base.port}"


_CLONE_LOCK = threading.Lock()


def new_client(store: dist.Store, what: str, timeout: float | None = None) -> dist.Store:
    """A new client of ``store``'s server (its clone, under the same prefixes), made within about
    ``timeout`` seconds (``$DISTRIBUTE_UTILS_TIMEOUT`` or the default when None). Every new client of the
    library is made here: a plain ``clone()`` connects with the store's own timeout (often minutes) and
    retries, so a rank whose store host died would wait that long.

    A dead server refuses a connection at once: each attempt looks first, and raises then. A live one
    may be slow to take a client (every new connection costs it a name lookup, and it may serve many
    ranks on a loaded host): attempts of at most :data:`CONNECT_ATTEMPT_S` are repeated while it
    answers, until ``timeout``.

    Raises:
        PeerLostError: the server no longer takes connections (naming its ``host:port``), or took no
            client within ``timeout``.
    """
    base = _tcp_store(store)
    if base is None:
        return store.clone()  # type: ignore[attr-defined]  # torch's stub lacks Store.clone (a method since torch 2.3)
    seconds = resolve_timeout(timeout)
    deadline = time.monotonic() + seconds
    while True:
        # A clone that cannot connect waits its timeout, then may wait and try once more: a third of
        # what is left keeps each attempt (a look, then a clone) within the deadline.
        attempt = max(min((deadline - time.monotonic()) / 3, CONNECT_ATTEMPT_S), 0.01)
        problem: BaseException | None = refusal(store, attempt)
        if isinstance(problem, ConnectionRefusedError):
            raise store_gone(what, store, problem)
        if problem is None:
            with _CLONE_LOCK:  # (clones of one store from several threads: each restores what it found)
                before = base.timeout  # type: ignore[attr-defined]  # (a property the stubs do not list)
                base.set_timeout(timedelta(seconds=attempt))
                try:
                    client = store.clone()  # type: ignore[attr-defined]  # torch's stub lacks Store.clone
                except Exception as exc:
                    problem = exc
                finally:
                    base.set_timeout(before)
            if problem is None:
                client.set_timeout(before)
                return client
        if time.monotonic() + attempt > deadline:
            raise _lost_contact(f"{what} (no new client within {seconds:g} s)", store, problem)
        logger.debug("%s: no new store client within %g s, trying again: %s", what, attempt, problem)


def _mark_lost(store: dist.Store, error: PeerLostError) -> None:
    """Remember that the default process group's store is gone (when ``store`` is a client of it):
    every later call raises ``error`` again at once."""
    address = _address(store)
    try:
        pg = dist.distributed_c10d._get_default_group()
        same = address is not None and _address(dist.distributed_c10d._get_default_store()) == address
    except (ValueError, RuntimeError, AttributeError):  # no default group (any more)
        return
    if same:
        _LOST.setdefault(pg, error)
        current = _CURRENT
        if current is not None and current.pg() is pg and current.lost is None:
            current.lost = error


def _lost_again(error: PeerLostError) -> PeerLostError:
    """What a call raises once the store is known to be gone (see :func:`_mark_lost`)."""
    return PeerLostError(
        f"{error} (found by an earlier call; every call of this process group fails so)", error.missing
    )


def refusal(store: dist.Store, timeout: float = PROBE_TIMEOUT_S) -> OSError | None:
    """Why the server of ``store`` (a ``TCPStore``, maybe under prefix stores) takes no connection within
    ``timeout`` seconds now (a dead one refuses at once); None when it does, or is not a ``TCPStore``."""
    base = _tcp_store(store)
    if base is None:
        return None
    try:
        socket.create_connection((base.host, base.port), timeout=timeout).close()
    except OSError as exc:
        return exc
    return None


def wait_values(
    store: dist.Store,
    keys: list[str],
    ranks: Sequence[int],
    timeout: float,
    what: str,
    generation: Callable[[int], int | None] | None = None,
    mine: int | None = None,
) -> list[bytes]:
    """Values of ``keys`` (posted by ``ranks``, one each), waiting at most ``timeout`` seconds (no
    watch on dead peers: see :func:`distribute_utils.liveness.wait_watched`).

    Raises:
        PeerLostError: some of ``ranks`` did not post in time (named), or the store itself is gone.
    """
    if not keys:
        return []
    try:
        store.set_timeout(timedelta(seconds=timeout))
        return store.multi_get(keys)
    except Exception as exc:
        raise_unless_arrived(exc, store, keys, ranks, timeout, what, generation, mine)
    return store.multi_get(keys)  # they arrived just as the wait gave up


def raise_unless_arrived(
    exc: Exception,
    store: dist.Store,
    keys: Sequence[str],
    ranks: Sequence[int],
    timeout: float,
    what: str,
    generation: Callable[[int], int | None] | None = None,
    mine: int | None = None,
) -> None:
    """After a wait for ``keys`` (of ``ranks``) failed with ``exc``: raise :class:`PeerLostError` naming
    the ranks whose key is still missing, or naming the store when it does not answer; return when
    every key arrived just as the wait gave up."""
    try:
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
    except Exception:
        raise store_lost(what, exc, store) from None
    if missing:
        raise late(what, missing, timeout, generation, mine) from None


def late(
    what: str,
    missing: list[int],
    timeout: float,
    generation: Callable[[int], int | None] | None,
    mine: int | None,
) -> PeerLostError:
    note = ""
    if generation is not None and mine is not None:
        other = {r: generation(r) for r in missing[:4]}
        stale = {r: g for r, g in other.items() if g != mine}
        if stale:
            note = (
                f"; rank(s) {sorted(stale)} are in another generation of this store ({stale}, this rank: "
                f"{mine}): every rank must use distribute_utils in every process group it joins, "
                "or the job must start from a fresh store"
            )
    return PeerLostError(
        f"{what}: rank(s) {short(missing)} did not arrive within {timeout:g} s "
        f"(set the timeout argument or ${TIMEOUT_ENV} to wait longer){note}",
        missing,
    )


# -- one incarnation of the default process group ----------------------------------------------------
class PeerDirectory:
    """Where ranks run, posted once per rank and read only where needed (never all-to-all).

    Each rank posts its :class:`ProcessInfo` under ``info/<rank>`` and appends its rank to
    the list of its shared-memory domain (and of its direct domain, when it has one); a rank reads
    another's info when it first needs it (cached), and the list of its own domain when the watchdog
    needs its local peers. A sender reads O(1) keys per gather list, a first rank O(its list)
    (:meth:`together`).
    """

    def __init__(self, store: dist.Store, prefix: str, rank: int, me: ProcessInfo) -> None:
        self.store, self.prefix, self.rank, self.me = store, prefix, rank, me
        self._lock = threading.Lock()
        self._infos: dict[int, ProcessInfo] = {rank: me}
        self._local: dict[int, ProcessInfo] = {}
        self._local_read = 0.0
        self._local_every = _LOCAL_REFRESH_S  # (see local_peers)
        self._watch_client: dist.Store | None = None
        # Listed in its domain first: whoever has read a rank's info finds it there (see on_this_host).
        store.append(self._domain_key(me), f"{rank},".encode())  # type: ignore[attr-defined]  # torch's stub lacks Store.append
        if me.direct_domain is not None:
            store.append(self._direct_key(me), f"{rank},".encode())  # type: ignore[attr-defined]  # (as above)
        store.multi_set([self._key(rank)], [msgpack.packb(me.to_wire())])  # type: ignore[attr-defined]  # torch's stub lacks Store.multi_set

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/info/{rank}"

    def _domain_key(self, info: ProcessInfo) -> str:
        return f"{self.prefix}/domain/{digest((info.shm_domain, info.pid_namespace))}"

    def _direct_key(self, info: ProcessInfo) -> str:
        return f"{self.prefix}/direct/{digest(info.direct_domain)}"

    def together(self, ranks: Sequence[int], store: dist.Store, timeout: float, what: str) -> bool:
        """Whether every rank of ``ranks`` (this one among them) runs in this process's direct domain
        (:attr:`ProcessInfo.direct_domain`); the same answer on each of them, once every one has posted.

        ``ranks[0]`` reads the info of every rank of the list (O(len(ranks)) keys). Any other rank reads
        ``ranks[0]``'s info and the list of its own direct domain (two keys, O(ranks on this host) bytes).
        Where that list lacks some of ``ranks``, it waits until they have all posted their infos (one
        wait, no value read) and reads the list again: a rank is listed before it posts its info, so one
        still missing then runs elsewhere. O(1) keys read, never O(len(ranks)), however staggered the start.
        """
        domain = self.me.direct_domain
        if domain is None:
            return False
        if ranks[0] == self.rank:
            return all(i.direct_domain == domain for i in self.infos(ranks, store, timeout, what))
        if self.info(ranks[0], store, timeout, what).direct_domain != domain:
            return False
        listed = self._direct_list(store, what)
        unlisted = [r for r in ranks if r not in listed]
        if unlisted:
            keys = [self._key(r) for r in unlisted]
            try:
                store.wait(keys, timedelta(seconds=timeout))
            except Exception as exc:
                raise_unless_arrived(exc, store, keys, unlisted, timeout, what)
            listed = self._direct_list(store, what)
        return all(r in listed for r in ranks)

    def _direct_list(self, store: dist.Store, what: str) -> set[int]:
        """The ranks that have posted that they run in this process's direct domain."""
        try:
            raw = store.get(self._direct_key(self.me))
        except Exception as exc:
            raise store_lost(what, exc, store) from None
        return {int(r) for r in raw.decode().split(",") if r}

    def known(self) -> dict[int, ProcessInfo]:
        """The infos this process has read (a copy; no store operation)."""
        with self._lock:
            return dict(self._infos)

    def info(self, rank: int, store: dist.Store, timeout: float, what: str) -> ProcessInfo:
        """Where ``rank`` runs (waits up to ``timeout`` for it to post; cached)."""
        found = self._infos.get(rank)
        if found is None:
            value = wait_values(store, [self._key(rank)], [rank], timeout, what)[0]
            found = ProcessInfo.from_wire(msgpack.unpackb(value))
            with self._lock:
                self._infos[rank] = found
        return found

    def infos(self, ranks: Sequence[int], store: dist.Store, timeout: float, what: str) -> list[ProcessInfo]:
        """Infos of ``ranks`` (one wait for all of those not cached yet)."""
        missing = [r for r in ranks if r not in self._infos]
        if missing:
            self._remember(
                missing, wait_values(store, [self._key(r) for r in missing], missing, timeout, what)
            )
        return [self._infos[r] for r in ranks]

    def on_this_host(self, store: dist.Store) -> int:
        """How many ranks have posted that they run in this process's domain (this one included; every
        rank whose info this process has read among them)."""
        return len({r for r in store.get(self._domain_key(self.me)).decode().split(",") if r})

    def _remember(self, ranks: Sequence[int], values: Sequence[bytes]) -> None:
        with self._lock:
            for r, v in zip(ranks, values):
                self._infos[r] = ProcessInfo.from_wire(msgpack.unpackb(v))

    def watch_client(self, timeout: float | None = None) -> dist.Store:
        """The watchdog thread's own client of the store, one per process group incarnation (every new
        connection costs the store server a name lookup: see docs/performance.md); made by a waiter,
        within ``timeout``.

        Raises:
            PeerLostError: the store's server is gone.
        """
        if self._watch_client is None:
            self._watch_client = new_client(self.store, "watching local ranks", timeout)
        return self._watch_client

    def local_peers(self) -> dict[int, ProcessInfo]:
        """Ranks this process can watch by pid (read by the watchdog thread; those last read when the
        store does not answer). Refreshed at most twice a second, and half as often after each refresh
        that found the same ranks, down to once every :data:`_LOCAL_REFRESH_MAX_S`."""
        now = time.monotonic()
        if now - self._local_read < self._local_every:
            return self._local
        try:
            client = self.watch_client()
            listed = client.get(self._domain_key(self.me)).decode().split(",")
            ranks = [int(r) for r in listed if r and int(r) != self.rank]
            # Infos not read yet: all at once when all are posted (as they are but while ranks start),
            # else each that is (a rank is listed before its info is posted). Read once: a rank's info
            # never changes within an incarnation.
            unread = [r for r in ranks if r not in self._infos]
            if unread and client.check([self._key(r) for r in unread]):
                self._remember(unread, client.multi_get([self._key(r) for r in unread]))  # type: ignore[attr-defined]  # torch's stub lacks Store.multi_get
            else:
                posted = [r for r in unread if client.check([self._key(r)])]
                self._remember(posted, [client.get(self._key(r)) for r in posted])
            found = {}
            for r in ranks:
                info = self._infos.get(r)
                if info is not None and self.me.can_watch(info):
                    found[r] = info
        except Exception as exc:  # the store is gone: its waiters say so
            logger.debug("could not read the ranks on this host: %s", exc)
            return self._local
        # Ranks join their host's list when they start: while it is unchanged, look less often (every
        # process of a job would otherwise ask the store twice a second during every long wait).
        same = found.keys() == self._local.keys()
        self._local_every = min(2 * self._local_every, _LOCAL_REFRESH_MAX_S) if same else _LOCAL_REFRESH_S
        self._local, self._local_read = found, now
        return found


class Member(Protocol):
    """What the incarnation needs of a group's companion (:class:`distribute_utils.sync.GroupSync`)."""

    rank: int
    namespace: str

    def entry(self, number: int) -> list[Any] | str | None: ...

    def compare(self, number: int, asker: int, asking: Any, entry: list[Any] | str | None) -> None: ...

    def close(self) -> None: ...


T = TypeVar("T")


class Incarnation:
    """Everything cached for one default process group; dropped when it is replaced."""

    lost: PeerLostError | None = None  # the store is gone: every call raises this (see _mark_lost)

    def __init__(self, pg: dist.ProcessGroup, timeout: float | None) -> None:
        what = "joining the job's rendezvous store"
        self.pg = weakref.ref(pg)
        self.store = new_client(dist.distributed_c10d._get_default_store(), what, timeout)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        me = this_process()
        if not answer_inquiries(me, _answer):  # no direct rounds with a process that cannot listen
            me = dataclasses.replace(me, net_namespace=-1)
        try:
            self.generation = int(self.store.add(f"{_ROOT}/generation/{self.rank}", 1))
            self.prefix = f"{_ROOT}/g{self.generation}"
            self.peers = PeerDirectory(self.store, self.prefix, self.rank, me)
        except Exception as exc:
            raise store_lost(what, exc, self.store) from None
        self.state = group_scope(pg)  # closed when the group goes (see distribute_utils.owners)
        self.companions: dict[tuple[int, ...], Member] = {}
        self.by_namespace: dict[str, Member] = {}  # the same, for the answering thread
        self.world: Member | None = None
        self.lock = threading.Lock()

    def own(self, kind: type[T]) -> T:
        """The one ``kind`` of this group (made on first use, its ``close()`` called when the group
        goes, newest first): :meth:`distribute_utils.owners.Owner.own` of the group's scope."""
        return self.state.own(kind)

    def generation_of(self, rank: int) -> int | None:
        """The generation ``rank`` is in (for messages when a wait fails)."""
        try:
            key = f"{_ROOT}/generation/{rank}"
            return int(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            return None


_STATE_LOCK = threading.Lock()
_CURRENT: Incarnation | None = None
# Default process groups whose store is gone (see _mark_lost), also those whose incarnation never began.
_LOST: weakref.WeakKeyDictionary[dist.ProcessGroup, PeerLostError] = weakref.WeakKeyDictionary()


# In a process forked while its parent had a default process group: (the parent's pid, that group).
_INHERITED: tuple[int, weakref.ref[dist.ProcessGroup]] | None = None


def _note_fork() -> None:
    """A forked child: the default group it inherits is its parent's (the store's and gloo's connections,
    this package's sockets), and nothing here may use it (see :func:`incarnation`)."""
    global _INHERITED
    _INHERITED = None
    if dist.is_available() and dist.is_initialized():
        _INHERITED = (os.getppid(), weakref.ref(dist.distributed_c10d._get_default_group()))


after_fork(_note_fork)


def incarnation(timeout: float | None = None) -> Incarnation:
    """The state of the current default process group, made anew after re-initialisation (its store
    client within ``timeout``).

    Raises:
        ForkedProcessError: the default group is one this process inherited by a fork.
        PeerLostError: the group's store is gone (found now, or by an earlier call: then at once).
    """
    global _CURRENT
    pg = dist.group.WORLD if _DISTRIBUTED else None  # the default group (None before init_process_group)
    if pg is None:
        raise _not_initialized()
    if _INHERITED is not None and _INHERITED[1]() is pg:
        raise ForkedProcessError(
            f"distribute_utils called in a process (pid {os.getpid()}) forked after its parent (pid "
            f"{_INHERITED[0]}) joined the default process group, whose store and sockets stay the "
            "parent's; gather in the parent or start the child with spawn"
        )
    current = _CURRENT
    if current is not None and current.pg() is pg:
        if current.lost is not None:
            raise _lost_again(current.lost)
        return current
    with _STATE_LOCK:
        if _CURRENT is None or _CURRENT.pg() is not pg:
            lost = _LOST.get(pg)
            if lost is not None:
                raise _lost_again(lost)
            if _CURRENT is not None:
                for old in _CURRENT.companions.values():
                    old.close()
                _CURRENT.state.close()
                _CURRENT = None
            _CURRENT = Incarnation(pg, timeout)
        return _CURRENT


def _answer(namespace: str, number: int, asker: int, asking: Any) -> tuple[int, Any] | None:
    """The answering thread's lookup (:func:`~distribute_utils.mailbox.answer_inquiries`): this rank and
    its entry for call ``number`` of the group whose namespace is ``namespace``; rank ``asker``'s entry
    for that call (``asking``) is compared with it (:meth:`~.sync.GroupSync.compare`)."""
    current = _CURRENT
    sync = current.by_namespace.get(namespace) if current is not None else None
    if sync is None:
        return None
    entry = sync.entry(number)
    sync.compare(number, asker, asking, entry)
    return sync.rank, entry
