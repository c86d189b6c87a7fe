"""Synchronisation of a set of ranks on the CPU, through the job's rendezvous store.

Every set of ranks gets one :class:`GroupSync`, its CPU companion, made on first use and
cached for the life of the default process group: its own client of the ``TCPStore`` that
``init_process_group`` already runs (so threads gathering on different groups never queue
behind each other), a private namespace and a call counter. It works on any group, NCCL
included, needs no extra process group, and names the ranks that did not arrive.

Every operation costs O(N) store operations for N ranks, never N²:

- a **barrier** is torch's own pattern: each rank posts an arrival key, ``add``\\ s to a counter,
  and the last one to arrive posts the key everybody waits on (one wait per rank);
- a **gather call** (:class:`Call`, driven by :mod:`distribute_utils.gather`): each rank posts
  one *claim*; the first rank of each gather reads only its own participants' claims and
  posts one *verdict*; a sender waits for that one verdict. One hop each way. Ranks of one
  host send claims and verdicts to each other's mailboxes instead (:meth:`Call.send_direct`,
  :meth:`Call.receive_direct`; :mod:`distribute_utils.mailbox`): no store operation at all.
- an **exchange** (all-gather of small values) goes to the group's first rank and back.

Keys are removed by the rank that posted them once every rank has provably moved on: after
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

import atexit
import dataclasses
import hashlib
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import msgpack
import torch.distributed as dist

from ._host import ProcessInfo, process_alive, this_process
from .errors import ForkedProcessError, PeerLostError
from .mailbox import ANSWER, Mailbox, MailboxError, answer_inquiries

__all__ = [
    "COLLECT_EVERY",
    "CONNECT_ATTEMPT_S",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "Call",
    "GroupSync",
    "barrier",
    "companion",
    "group_ranks",
    "on_new_incarnation",
    "require_initialized",
    "resolve_timeout",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "DISTRIBUTE_UTILS_TIMEOUT"
COLLECT_EVERY = 64  # calls between the group-wide barriers after which keys are removed
TOMBSTONE = b"\x00dead"
_WATCH_INTERVAL_S = 0.1
_WATCH_GRACE_S = 0.05  # waits shorter than this never cost the watchdog (or the CPU) anything
GRACE_S = _WATCH_GRACE_S  # a direct round only listens this long before it looks at records and pids
RETRY_S = 0.002  # how soon an undelivered direct message is sent again within the grace
_PROBE_TIMEOUT_S = 1.0  # the janitor's look whether a store's server still takes connections
CONNECT_ATTEMPT_S = 5.0  # one attempt of a new store client to connect (repeated while the server answers)
_EXIT_S = 1.0  # how long a dead process's last threads may take to exit (and close its sockets)
_JANITOR_CONNECT_S = 4 * _PROBE_TIMEOUT_S  # the janitor's new client: well within its join at exit (5 s)
_RECORDS_KEPT = 16  # calls a rank remembers for inquiries (its latest first)
_ROOT = "distribute_utils"


def _timeout_env() -> str | None:
    """``$DISTRIBUTE_UTILS_TIMEOUT``: every call of every rank looks, and mostly finds it unset, where
    ``os.environ.get`` raises and catches ``KeyError`` twice (~9 µs when cold). CPython's
    ``os.environ`` keeps its variables in a dict, which says so without raising."""
    data = getattr(os.environ, "_data", None)
    if _TIMEOUT_KEY is not None and type(data) is dict and _TIMEOUT_KEY not in data:
        return None
    return os.environ.get(TIMEOUT_ENV)


_TIMEOUT_KEY = os.environ.encodekey(TIMEOUT_ENV) if hasattr(os.environ, "encodekey") else None


def resolve_timeout(timeout: float | timedelta | None) -> float:
    """Seconds to wait at most: ``timeout``, else ``$DISTRIBUTE_UTILS_TIMEOUT``, else 600.

    Raises:
        ValueError: a timeout that is not a positive number of seconds.
    """
    source = "timeout"
    if timeout is None:
        env = _timeout_env()
        if env is None:
            return DEFAULT_TIMEOUT_S
        source = f"${TIMEOUT_ENV}"
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"{source}={env!r} is not a number of seconds") from None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{source} must be a positive number of seconds or a timedelta; got {timeout!r}")
    return float(timeout)


def require_initialized() -> None:
    """Raises RuntimeError (saying what to call) unless a default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
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


def _digest(value: object) -> str:
    return hashlib.blake2b(repr(value).encode(), digest_size=8).hexdigest()


def _store_lost(what: str, exc: BaseException, store: dist.Store) -> PeerLostError:
    """The error of an operation on ``store`` that failed with ``exc``: when its server no longer takes
    connections, the store is gone for good (see :func:`_store_gone`)."""
    refused = _refusal(store)
    if isinstance(refused, ConnectionRefusedError):
        return _store_gone(what, store, refused)
    return _lost_contact(what, store, exc)


def _lost_contact(what: str, store: dist.Store, exc: BaseException) -> PeerLostError:
    """``store`` did not serve an operation, but its server was not seen gone (it may be slow, or its host
    unreachable): this call fails, later ones try again."""
    address = _address(store)
    at = f" at {address}" if address else ""
    return PeerLostError(f"{what}: lost contact with the job's rendezvous store{at}: {exc}", ())


def _store_gone(
    what: str, store: dist.Store, exc: BaseException | str, missing: tuple[int, ...] | list[int] = ()
) -> PeerLostError:
    """``store``'s server is gone (it ran in the launcher or in a rank, rank 0 for ``env://`` and
    ``mp.spawn`` jobs, that exited): the error, which every later call of this incarnation raises at
    once (see :func:`_incarnation`)."""
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


def _new_client(store: dist.Store, what: str, timeout: float | None = None) -> dist.Store:
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
        return store.clone()
    seconds = resolve_timeout(timeout)
    deadline = time.monotonic() + seconds
    while True:
        # A clone that cannot connect waits its timeout, then may wait and try once more: a third of
        # what is left keeps each attempt (a look, then a clone) within the deadline.
        attempt = max(min((deadline - time.monotonic()) / 3, CONNECT_ATTEMPT_S), 0.01)
        problem: BaseException | None = _refusal(store, attempt)
        if isinstance(problem, ConnectionRefusedError):
            raise _store_gone(what, store, problem)
        if problem is None:
            with _CLONE_LOCK:  # (clones of one store from several threads: each restores what it found)
                before = base.timeout  # type: ignore[attr-defined]  # (a property the stubs do not list)
                base.set_timeout(timedelta(seconds=attempt))
                try:
                    client = store.clone()
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


# -- liveness of local peers ---------------------------------------------------------------------
class _Watch:
    """One wait in progress: the keys a rank waits on, and whose death would fill them.

    ``awaited`` maps a rank to the key its death must fill (with :data:`TOMBSTONE` plus its
    rank number); ``arrived_key`` (for barriers) tells whether the rank had arrived first.
    """

    def __init__(
        self,
        source: _PeerDirectory,
        store: dist.Store,
        awaited: dict[int, str],
        arrived_key: Callable[[int], str] | None,
    ) -> None:
        self.source, self.store, self.awaited, self.arrived_key = source, store, awaited, arrived_key
        self.since = time.monotonic()


class _Watchdog:
    """One daemon thread per process that tombstones what dead local peers never posted."""

    def __init__(self) -> None:
        self._forked()
        self._closed = False
        atexit.register(self.close)
        os.register_at_fork(after_in_child=self._forked)  # a child starts without the thread

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watches: dict[int, _Watch] = {}
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """End the thread (at exit: never leave it inside a store call, see :class:`_Janitor`)."""
        with self._lock:
            self._closed = True
            self._watches.clear()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)

    def add(self, watch: _Watch) -> int:
        with self._lock:
            if self._closed:
                return 0
            ident = id(watch)
            self._watches[ident] = watch
            if self._thread is None:
                # Stop it at exit before anything registered earlier runs (torch registers its
                # own handlers at init_process_group): LIFO, so register when the thread starts.
                atexit.register(self.close)
                self._thread = threading.Thread(
                    target=self._run, name="distribute-utils-watchdog", daemon=True
                )
                self._thread.start()
        if not self._wake.is_set():  # the thread waits for it only when it found nothing to watch
            self._wake.set()
        return ident

    def remove(self, ident: int) -> None:
        with self._lock:
            self._watches.pop(ident, None)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                if self._closed:
                    return
                watches = list(self._watches.values())
                if not watches:
                    self._wake.clear()
            if not watches:
                continue
            # Most waits end within a millisecond: look only at those that outlast the grace.
            now = time.monotonic()
            due = [w for w in watches if now - w.since >= _WATCH_GRACE_S]
            for watch in due:
                try:
                    self._check(watch)
                except Exception:  # the store may be gone: the waiter will say so
                    logger.debug("watchdog check failed", exc_info=True)
            if due:
                time.sleep(_WATCH_INTERVAL_S)
            else:
                oldest = min(w.since for w in watches)
                time.sleep(max(0.0, _WATCH_GRACE_S - (now - oldest)))

    @staticmethod
    def _check(watch: _Watch) -> None:
        local = watch.source.local_peers()
        for rank, key in watch.awaited.items():
            info = local.get(rank)
            if info is None or process_alive(info):
                continue
            if watch.arrived_key is not None and watch.store.check([watch.arrived_key(rank)]):
                continue  # it arrived, then exited: not what anybody waits for
            watch.store.compare_set(key, b"", TOMBSTONE + str(rank).encode())


_WATCHDOG = _Watchdog()


class _Janitor:
    """Deletes keys of finished calls off the critical path, on its own store clients.

    Stopped and joined at interpreter exit: a daemon thread still inside a store call while
    the interpreter tears down makes the process abort ("terminate called without an active
    exception"), so the queue is drained first (bounded to a few seconds). It never connects
    to a store that nobody holds any more, or whose server no longer answers (a new client
    would retry for the store's whole timeout): their keys go with them.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[weakref.ref[dist.Store], list[str]] | None] = queue.SimpleQueue()
        self._clients: weakref.WeakKeyDictionary[dist.Store, dist.Store] = weakref.WeakKeyDictionary()
        self._thread: threading.Thread | None = None
        self._stopped = False
        atexit.register(self.stop)

    def delete(self, store: dist.Store, keys: list[str]) -> None:
        if self._stopped or not keys:
            return
        if self._thread is None or not self._thread.is_alive():
            atexit.register(self.stop)  # as the watchdog: registered after torch's, so it runs first
            self._thread = threading.Thread(target=self._run, name="distribute-utils-janitor", daemon=True)
            self._thread.start()
        self._queue.put((weakref.ref(store), keys))

    def stop(self) -> None:
        """Finish the pending deletions and end the thread (at exit)."""
        self._stopped = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._delete(*item)

    def _delete(self, store_ref: weakref.ref[dist.Store], keys: list[str]) -> None:
        store = store_ref()  # (held only during the call: a store the job dropped is not kept alive)
        if store is None:
            return
        try:
            client = self._clients.get(store)
            if client is None:
                # At exit, or with the store's server gone: never a new connection (nor a long one).
                if self._stopped:
                    return
                client = self._clients[store] = _new_client(store, "deleting keys", _JANITOR_CONNECT_S)
            for key in keys:
                client.delete_key(key)
        except Exception:  # the job is ending or the store is gone: nothing to clean
            logger.debug("could not delete %d keys", len(keys), exc_info=True)


def _refusal(store: dist.Store, timeout: float = _PROBE_TIMEOUT_S) -> OSError | None:
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


def _answers(store: dist.Store) -> bool:
    """Whether the server of ``store`` takes a connection now (see :func:`_refusal`)."""
    return _refusal(store) is None


_JANITOR = _Janitor()


# -- one incarnation of the default process group ----------------------------------------------------
class _PeerDirectory:
    """Where ranks run, posted once per rank and read only where needed (never all-to-all).

    Each rank posts its :class:`ProcessInfo` under ``info/<rank>`` and appends its rank to
    the list of its shared-memory domain; a rank reads another's info when it first needs it
    (cached), and the list of its own domain when the watchdog needs its local peers.
    """

    def __init__(self, store: dist.Store, prefix: str, rank: int, me: ProcessInfo) -> None:
        self.store, self.prefix, self.rank, self.me = store, prefix, rank, me
        self._lock = threading.Lock()
        self._infos: dict[int, ProcessInfo] = {rank: me}
        self._local: dict[int, ProcessInfo] = {}
        self._local_read = 0.0
        self._watch_client: dist.Store | None = None
        # Listed in its domain first: whoever has read a rank's info finds it there (see on_this_host).
        store.append(self._domain_key(me), f"{rank},".encode())
        store.multi_set([self._key(rank)], [msgpack.packb(me.to_wire())])

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/info/{rank}"

    def _domain_key(self, info: ProcessInfo) -> str:
        return f"{self.prefix}/domain/{_digest((info.shm_domain, info.pid_namespace))}"

    def info(self, rank: int, store: dist.Store, timeout: float, what: str) -> ProcessInfo:
        """Where ``rank`` runs (waits up to ``timeout`` for it to post; cached)."""
        found = self._infos.get(rank)
        if found is None:
            value = _wait_values(store, [self._key(rank)], [rank], timeout, what, None)[0]
            found = ProcessInfo.from_wire(msgpack.unpackb(value))
            with self._lock:
                self._infos[rank] = found
        return found

    def infos(self, ranks: Sequence[int], store: dist.Store, timeout: float, what: str) -> list[ProcessInfo]:
        """Infos of ``ranks`` (one wait for all of those not cached yet)."""
        missing = [r for r in ranks if r not in self._infos]
        if missing:
            self._remember(
                missing, _wait_values(store, [self._key(r) for r in missing], missing, timeout, what, None)
            )
        return [self._infos[r] for r in ranks]

    def on_this_host(self, store: dist.Store) -> int:
        """How many ranks have posted that they run in this process's domain (this one included; every
        rank whose info this process has read among them)."""
        return len({r for r in store.get(self._domain_key(self.me)).decode().split(",") if r})

    def posted(self, ranks: Sequence[int], store: dist.Store) -> dict[int, ProcessInfo]:
        """Infos of ``ranks`` without waiting: those not cached are read when all of them have posted
        (one check), else left out for now."""
        missing = [r for r in ranks if r not in self._infos]
        if missing:
            keys = [self._key(r) for r in missing]
            if store.check(keys):
                self._remember(missing, store.multi_get(keys))
        infos = self._infos
        return {r: infos[r] for r in ranks if r in infos}

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
            self._watch_client = _new_client(self.store, "watching local ranks", timeout)
        return self._watch_client

    def local_peers(self) -> dict[int, ProcessInfo]:
        """Ranks this process can watch by pid (read by the watchdog thread, refreshed ≤ 2/s; those
        last read when the store does not answer)."""
        now = time.monotonic()
        if now - self._local_read < 0.5:
            return self._local
        try:
            client = self.watch_client()
            listed = client.get(self._domain_key(self.me)).decode().split(",")
            ranks = [int(r) for r in listed if r and int(r) != self.rank]
            found = {}
            for r in ranks:
                info = self._infos.get(r)
                if info is None and client.check([self._key(r)]):
                    info = ProcessInfo.from_wire(msgpack.unpackb(client.get(self._key(r))))
                if info is not None and self.me.can_watch(info):
                    found[r] = info
        except Exception as exc:  # the store is gone: its waiters say so
            logger.debug("could not read the ranks on this host: %s", exc)
            return self._local
        self._local, self._local_read = found, now
        return found


class _Incarnation:
    """Everything cached for one default process group; dropped when it is replaced."""

    lost: PeerLostError | None = None  # the store is gone: every call raises this (see _mark_lost)

    def __init__(self, pg: dist.ProcessGroup, timeout: float | None) -> None:
        what = "joining the job's rendezvous store"
        self.pg = weakref.ref(pg)
        self.store = _new_client(dist.distributed_c10d._get_default_store(), what, timeout)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        me = this_process()
        if not answer_inquiries(me, _answer):  # no direct rounds with a process that cannot listen
            me = dataclasses.replace(me, net_namespace=-1)
        try:
            self.generation = int(self.store.add(f"{_ROOT}/generation/{self.rank}", 1))
            self.prefix = f"{_ROOT}/g{self.generation}"
            self.peers = _PeerDirectory(self.store, self.prefix, self.rank, me)
        except Exception as exc:
            raise _store_lost(what, exc, self.store) from None
        weakref.finalize(pg, _run_reset_hooks)  # destroy_process_group() drops the group
        self.companions: dict[tuple[int, ...], GroupSync] = {}
        self.by_namespace: dict[str, GroupSync] = {}  # the same, for the answering thread
        self.world: GroupSync | None = None
        self.lock = threading.Lock()

    def generation_of(self, rank: int) -> int | None:
        """The generation ``rank`` is in (for messages when a wait fails)."""
        try:
            key = f"{_ROOT}/generation/{rank}"
            return int(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            return None


_STATE_LOCK = threading.Lock()
_CURRENT: _Incarnation | None = None
# Default process groups whose store is gone (see _mark_lost), also those whose incarnation never began.
_LOST: weakref.WeakKeyDictionary[dist.ProcessGroup, PeerLostError] = weakref.WeakKeyDictionary()
_RESET_HOOKS: list[Callable[[], None]] = []


def on_new_incarnation(hook: Callable[[], None]) -> None:
    """Call ``hook`` when the default process group is destroyed or replaced (to drop caches
    and give back resources)."""
    _RESET_HOOKS.append(hook)


def _run_reset_hooks() -> None:
    for hook in _RESET_HOOKS:
        try:
            hook()
        except Exception:
            logger.debug("a reset hook failed", exc_info=True)


# In a process forked while its parent had a default process group: (the parent's pid, that group).
_INHERITED: tuple[int, weakref.ref[dist.ProcessGroup]] | None = None


def _note_fork() -> None:
    """A forked child: the default group it inherits is its parent's (the store's and gloo's connections,
    this package's sockets), and nothing here may use it (see :func:`_incarnation`)."""
    global _INHERITED
    _INHERITED = None
    if dist.is_available() and dist.is_initialized():
        _INHERITED = (os.getppid(), weakref.ref(dist.distributed_c10d._get_default_group()))


os.register_at_fork(after_in_child=_note_fork)


def _incarnation(timeout: float | None = None) -> _Incarnation:
    """The state of the current default process group, made anew after re-initialisation (its store
    client within ``timeout``).

    Raises:
        ForkedProcessError: the default group is one this process inherited by a fork.
        PeerLostError: the group's store is gone (found now, or by an earlier call: then at once).
    """
    global _CURRENT
    try:
        pg = dist.distributed_c10d._get_default_group()
    except (ValueError, RuntimeError, AttributeError):
        require_initialized()  # says what to call
        raise
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
                _run_reset_hooks()
                for old in _CURRENT.companions.values():
                    old.close()
                _CURRENT = None
            _CURRENT = _Incarnation(pg, timeout)
        return _CURRENT


# -- waiting -------------------------------------------------------------------------------------
def _wait_values(
    store: dist.Store,
    keys: list[str],
    ranks: Sequence[int],
    timeout: float,
    what: str,
    watch: _Watch | None,
    generation: Callable[[int], int | None] | None = None,
    mine: int | None = None,
    tombstones: bool = True,
) -> list[bytes]:
    """Values of ``keys`` (posted by ``ranks``, one each), waiting at most ``timeout`` seconds.

    With ``tombstones`` (the default), a value the watchdog posted for a dead rank raises.

    Raises:
        PeerLostError: some of ``ranks`` did not post in time, or died (named), or the store
            itself is gone.
    """
    if not keys:
        return []
    ident = _WATCHDOG.add(watch) if watch is not None else 0
    try:
        store.set_timeout(timedelta(seconds=timeout))
        values = store.multi_get(keys)
    except Exception as exc:
        try:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        except Exception:
            raise _store_lost(what, exc, store) from None
        if not missing:
            values = store.multi_get(keys)  # they arrived just as the wait gave up
        else:
            raise _late(what, missing, timeout, generation, mine) from None
    finally:
        if ident:
            _WATCHDOG.remove(ident)
    dead = [r for r, v in zip(ranks, values) if v.startswith(TOMBSTONE)] if tombstones else []
    if dead:
        raise PeerLostError(f"{what}: rank(s) {dead} exited while this rank was waiting for them", dead)
    return values


def _exited(what: str, dead: dict[int, int], store: dist.Store) -> PeerLostError:
    """``dead`` (rank: pid) exited while this rank waited for them without the store (a direct round):
    when one of them hosted the store, its server is gone too, and the error says so (naming both)."""
    ranks = list(dead)
    message = f"{what}: rank(s) {ranks} exited while this rank was waiting for them"
    _await_last_threads(dead.values())
    refused = _refusal(store)
    if not isinstance(refused, ConnectionRefusedError):
        return PeerLostError(message, ranks)
    return _store_gone(message, store, refused, ranks)


def _await_last_threads(pids: Iterable[int], limit: float = _EXIT_S) -> None:
    """Waits (``limit`` seconds at most in all) until the processes ``pids``, whose main threads have
    exited, have no other thread left: only then are their descriptors closed (a store server's
    listening socket among them), so that a look at the server tells whether it went with them."""
    deadline = time.monotonic() + limit
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if len(os.listdir(f"/proc/{pid}/task")) <= 1:
                    break
            except OSError:  # reaped
                break
            time.sleep(0.005)


def _late(
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
            sync.store.multi_set(keys_all, data_all)
        except Exception as exc:
            raise _store_lost(f"posting to ranks {short(sync.ranks)}", exc, sync.store) from None
        sync.own_keys.extend(keys)

    def post_shared(self, tag: str, value: bytes) -> None:
        """Post a key of the call that is not per rank (e.g. a plan); collected by its poster."""
        key = self.key(tag)
        try:
            self.sync.store.set(key, value)
        except Exception as exc:
            raise _store_lost(f"posting to ranks {short(self.sync.ranks)}", exc, self.sync.store) from None
        self.sync.own_keys.append(key)

    def wait_for(self, tag: str, ranks: Sequence[int], timeout: float, what: str) -> list[bytes]:
        """The ``tag`` values of ``ranks``; a dead local rank or a late one is named."""
        keys = [self.key(tag, r) for r in ranks]
        return self.sync.wait(keys, ranks, timeout, what, dict(zip(ranks, keys)))

    def wait_shared(self, tag: str, owner: int, timeout: float, what: str) -> bytes:
        """A key of the call posted by ``owner`` (see :meth:`post_shared`)."""
        key = self.key(tag)
        return self.sync.wait([key], [owner], timeout, what, {owner: key})[0]

    def wait_verdict(self, first: int, timeout: float, what: str) -> bytes:
        """``first``'s ``v`` value. When it is late but has arrived (posted its ``c`` claim), it
        is given a second ``timeout``: its own waits are bounded, so its reason will come."""
        try:
            return self.wait_for("v", [first], timeout, what)[0]
        except PeerLostError as exc:
            if exc.missing != (first,) or not self.sync.has(self.key("c", first)):
                raise
        return self.wait_for("v", [first], timeout, what)[0]

    # -- direct rounds: one host, no store hop (see distribute_utils.mailbox) --------------------
    def record(self, entry: list[Any]) -> None:
        """Remember what this rank does in this call (``entry``, e.g. its kind and list): a partner of
        a direct round that waits past the grace asks for it (:meth:`receive_direct`). Kept in memory
        for this rank's last :data:`_RECORDS_KEPT` calls of the group; a later entry for the same call
        (a failure) replaces the earlier one."""
        sync = self.sync
        sync.records = [[self.number, *entry], *sync.records[: _RECORDS_KEPT - 1]]

    def send_direct(
        self, rank: int, kind: int, parts: Sequence[bytes | bytearray | memoryview], timeout: float = 0.0
    ) -> bool:
        """Send one message (``parts``, concatenated) to ``rank``'s mailbox of this group; False when
        it does not listen (yet) or its queue stayed full for ``timeout`` seconds."""
        sync = self.sync
        return sync.mailbox().send(sync.infos[rank], self.number, sync.rank, kind, parts, timeout)

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
        still undelivered: every :data:`RETRY_S` within the grace, then every :data:`_WATCH_INTERVAL_S`.
        Within the grace this only listens. Past it, every :data:`_WATCH_INTERVAL_S`: a missing rank
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
        mailbox = sync.mailbox()
        missing = {r: sync.infos[r] for r in ranks}
        there: dict[int, bool] = {}
        start = time.monotonic()
        deadline = start + timeout
        tick = start + min(GRACE_S, timeout)
        retry = start + RETRY_S if undelivered is not None else float("inf")
        chance = second_chance
        while missing:
            now = time.monotonic()
            if now >= retry:
                assert undelivered is not None
                retry = (
                    now + (RETRY_S if now < tick else _WATCH_INTERVAL_S) if undelivered() else float("inf")
                )
            if now >= tick:
                # A peer's message comes before its exit, and before its answer that it went past.
                dead = {r: info.pid for r, info in missing.items() if not process_alive(info)}
                self._take(mailbox.receive(self.number, missing, 0.0), kind, missing, there, judge, arrived)
                if any(r in missing for r in dead):
                    raise _exited(what, {r: pid for r, pid in dead.items() if r in missing}, sync.store)
                if not missing:
                    break
                if now >= deadline:
                    if not (chance and all(there.get(r, False) for r in missing)):
                        generation, lookup = sync.generation if sync.generation is not None else (None, None)
                        raise _late(what, list(missing), timeout, lookup, generation)
                    chance, deadline = False, now + timeout
                for info in missing.values():
                    mailbox.inquire(info, self.number, sync.rank)
                tick = now + _WATCH_INTERVAL_S
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
        peers: _PeerDirectory | None = None,
        generation: tuple[int, Callable[[int], int | None]] | None = None,
    ) -> None:
        self.ranks = ranks
        self.rank = rank
        self.store = store
        self.namespace = namespace
        self.token_base = _digest((namespace, ranks))[:8]
        self.directory = peers
        self.generation = generation
        self._calls = 0
        self._collected = 0  # calls before this number have been collected
        self.own_keys: list[str] = []
        self._busy = threading.Lock()
        self._digests: dict[tuple[int, ...], str] = {}
        # The gather layer's routes over this group, kept for the incarnation (see gather._Gather.plan).
        self.routes: dict[Any, Any] = {}
        self.records: list[list[Any]] = []  # this rank's latest entries (see Call.record)
        self.infos: dict[int, ProcessInfo] = {}  # ranks of direct rounds (see direct())
        self._direct: dict[tuple[int, ...], bool] = {}
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
        records = self.records  # one read: the calling thread replaces the list, never changes it
        for record in records:
            if record[0] == number:
                return record[1:]
        if records and number < records[0][0]:
            return "past"  # it has gone on, and took no part in that call as a gather
        return None

    def direct(self, ranks: Sequence[int], timeout: float, what: str) -> bool:
        """Whether ``ranks`` (this rank among them) run on one host in one pid and network namespace,
        so that a round among them can go through their mailboxes; the same answer on each of them."""
        key = tuple(ranks)
        found = self._direct.get(key)
        if found is None:
            found = False
            if self.directory is not None:
                infos = self.directory.infos(key, self.store, timeout, what)
                domain = self.directory.me.direct_domain
                found = domain is not None and all(i.direct_domain == domain for i in infos)
                if found:
                    self.infos.update(zip(key, infos))
                    if self._mailbox is not None and not self._polling_decided:
                        self._decide_polling(self._mailbox)
            if len(self._direct) > 4096:
                self._direct.clear()
            self._direct[key] = found
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
            if len(self._digests) > 4096:
                self._digests.clear()
            found = self._digests[key] = _digest(list(key))
        return found

    # -- calls ---------------------------------------------------------------------------------
    def new_call(self, timeout: float) -> Call:
        """The next call; every rank must make the same calls in the same order.

        Every :data:`COLLECT_EVERY` calls without a barrier, a barrier comes first (as a call of
        its own), after which the keys of earlier calls are removed.
        """
        if self._calls - self._collected >= COLLECT_EVERY:
            self._barrier(
                self._next(), timeout, f"a barrier over ranks {short(self.ranks)} (collecting keys)"
            )
        return self._next()

    def _next(self) -> Call:
        call = Call(self, self._calls)
        self._calls += 1
        return call

    def has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def wait(
        self, keys: list[str], ranks: Sequence[int], timeout: float, what: str, awaited: dict[int, str] | None
    ) -> list[bytes]:
        watch = None
        if self.directory is not None and awaited:
            watch = _Watch(self.directory, self._watch_store(timeout), awaited, None)
        generation, lookup = self.generation if self.generation is not None else (None, None)
        return _wait_values(self.store, keys, ranks, timeout, what, watch, lookup, generation)

    def _watch_store(self, timeout: float) -> dist.Store:
        """The watchdog thread's client of the store (shared by every group of the incarnation), made
        within ``timeout``."""
        if self.directory is not None:
            return self.directory.watch_client(timeout)
        client = getattr(self, "_watch_client", None)
        if client is None:
            client = self._watch_client = _new_client(self.store, "watching local ranks", timeout)
        return client

    # -- barrier -------------------------------------------------------------------------------
    def barrier(self, timeout: float, what: str = "barrier") -> None:
        """Return once every rank of ``ranks`` has entered. Must be called on every rank."""
        with self.exclusive(what):
            self._barrier(self._next(), timeout, what)

    def _barrier(self, call: Call, timeout: float, what: str) -> None:
        n = len(self.ranks)
        go = call.key("go")
        try:
            self.store.set(call.key("in", self.rank), b"1")
            arrived = self.store.add(call.key("count"), 1)
            if arrived >= n:
                self.store.set(go, b"1")
        except Exception as exc:
            raise _store_lost(what, exc, self.store) from None
        self.own_keys.append(call.key("in", self.rank))
        if arrived < n:
            others = [r for r in self.ranks if r != self.rank]
            watch = None
            if self.peers is not None:
                watch = _Watch(
                    self.directory,
                    self._watch_store(timeout),
                    dict.fromkeys(others, go),
                    lambda r: call.key("in", r),
                )
            try:
                value = _wait_values(self.store, [go], [-1], timeout, what, watch, tombstones=False)[0]
            except PeerLostError as exc:
                if not exc.missing:  # the store itself is gone: nobody can be named from it
                    raise
                missing = [r for r in others if not self.has(call.key("in", r))]
                if not missing:
                    raise
                generation, lookup = self.generation if self.generation is not None else (None, None)
                raise _late(what, missing, timeout, lookup, generation) from None
            if value.startswith(TOMBSTONE):
                dead = int(value[len(TOMBSTONE) :])
                raise PeerLostError(
                    f"{what}: rank(s) [{dead}] exited while ranks {short(self.ranks)} were waiting for them",
                    [dead],
                )
        self._collect(call.number)

    def _collect(self, barrier_number: int) -> None:
        """Every rank has left every call before ``barrier_number``: remove our keys of those."""
        keys, self.own_keys = self.own_keys, self.own_keys[-1:]  # keep this barrier's arrival key
        keys = keys[:-1]
        if self.rank == self.ranks[0]:
            previous = Call(self, self._collected - 1) if self._collected > 0 else None
            if previous is not None:
                keys += [previous.key("count"), previous.key("go")]
        self._collected = barrier_number + 1 if barrier_number >= 0 else self._collected
        # One janitor client per incarnation, not per group: keyed by the store every group's was cloned from.
        _JANITOR.delete(self.directory.store if self.directory is not None else self.store, keys)

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
            raise RuntimeError("this companion has no peer directory")
        return self.directory.infos(self.ranks, self.store, timeout, f"looking up ranks {short(self.ranks)}")

    def exclusive(self, what: str) -> _Exclusive:
        """Hold the group for one operation; a second thread on the same group is refused."""
        return _Exclusive(self, what)


class _Exclusive:
    def __init__(self, sync: GroupSync, what: str) -> None:
        self.sync, self.what = sync, what

    def __enter__(self) -> None:
        if not self.sync._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{self.what}: another thread of this rank is inside an operation on ranks "
                f"{short(self.sync.ranks)}; operations on one group must come from one thread at a time "
                "(different groups may be used from different threads)"
            )

    def __exit__(self, *exc: object) -> None:
        self.sync._busy.release()


def _answer(namespace: str, number: int) -> tuple[int, Any] | None:
    """The answering thread's lookup (:func:`~distribute_utils.mailbox.answer_inquiries`): this rank and
    its entry for call ``number`` of the group whose namespace is ``namespace``."""
    current = _CURRENT
    sync = current.by_namespace.get(namespace) if current is not None else None
    return None if sync is None else (sync.rank, sync.entry(number))


def companion(ranks: Sequence[int] | dist.ProcessGroup | None, timeout: float | None = None) -> GroupSync:
    """The cached :class:`GroupSync` of ``ranks`` (a rank list, a group, or None for the world); a new
    one connects to the store within ``timeout`` (seconds; None: ``$DISTRIBUTE_UTILS_TIMEOUT`` or the default).

    Raises:
        ValueError: the calling rank is not among ``ranks``.
        PeerLostError: the job's store is gone (found now, or at once when an earlier call found it).
    """
    inc = _incarnation(timeout)
    if ranks is None and inc.world is not None:
        return inc.world
    world = ranks is None
    if ranks is None or isinstance(ranks, dist.ProcessGroup):
        ranks = group_ranks(ranks)
    key = tuple(ranks)
    sync = inc.companions.get(key)
    if sync is None:
        if inc.rank not in key:
            raise ValueError(
                f"rank {inc.rank} is not in group {short(key)}; only its members may synchronise on it"
            )
        with inc.lock:
            sync = inc.companions.get(key)
            if sync is None:
                sync = inc.companions[key] = GroupSync(
                    key,
                    inc.rank,
                    _new_client(inc.store, f"joining group {short(key)}", timeout),
                    f"{inc.prefix}/{_digest(key)}",
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
