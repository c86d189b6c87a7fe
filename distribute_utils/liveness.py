"""Internal. Liveness of peers: noticing dead local ranks while waiting, and removing finished calls' keys.

- The **watchdog** (:class:`Watchdog`, one daemon thread per process, started by the first wait that
  outlasts :data:`GRACE_S`) checks the pids of the local peers a wait depends on, and posts a
  tombstone (:data:`TOMBSTONE` plus the rank) in the key a dead one never posted, so survivors fail
  within a fraction of a second instead of at the timeout. Peers on other hosts are reported when
  the timeout expires. A wait may also name a :class:`StandIn`: a key where the awaited rank says
  whether it will post the awaited key at all; when it says not, the watchdog posts what it stands for
  there (so that ranks never post keys just in case somebody wrongly waits on them).
- The **janitor** (:class:`Janitor`, one daemon thread per process) deletes keys of finished calls
  off the critical path, on its own store clients.

Both threads are stopped and joined at interpreter exit (registered when each starts, so that they
stop before torch's own exit handlers run); a forked child starts without them. Nothing is
registered at import.

Call order: :func:`wait_watched` from any thread; :data:`WATCHDOG` and :data:`JANITOR` are this
process's instances.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch.distributed as dist

from .errors import PeerLostError
from .incarnation import PROBE_TIMEOUT_S, PeerDirectory, new_client, refusal, store_gone, wait_values
from .processes import ProcessInfo, process_alive

__all__ = [
    "GRACE_S",
    "JANITOR",
    "STAND_IN_S",
    "TOMBSTONE",
    "WATCHDOG",
    "WATCH_INTERVAL_S",
    "Janitor",
    "StandIn",
    "Watch",
    "Watchdog",
    "await_last_threads",
    "exited",
    "wait_watched",
]

logger = logging.getLogger(__name__)

TOMBSTONE = b"\x00dead"
WATCH_INTERVAL_S = 0.1  # how often the watchdog looks at the peers of a wait past the grace
GRACE_S = 0.05  # waits shorter than this never cost the watchdog (or the CPU) anything
_EXIT_S = 1.0  # how long a dead process's last threads may take to exit (and close its sockets)
_JANITOR_CONNECT_S = 4 * PROBE_TIMEOUT_S  # the janitor's new client: well within its join at exit (5 s)
STAND_IN_S = 1.0  # how long a wait with a stand-in lasts before the watchdog first reads its source
_STAND_IN_MAX_S = 8.0  # the longest gap between its reads of a source that is not there yet


class StandIn:
    """What the watchdog posts in a wait's key (``key``) for the awaited rank once that rank has said,
    in ``source``, that it will not post there itself: ``make(source's value)``, or None (it will).

    Made by the waiter (:meth:`distribute_utils.sync.Call.wait_verdict`: a gather's sender awaiting the
    verdict of a rank whose claim says it does not receive); ``make`` must be a function of the value
    alone. The watchdog first looks for ``source`` once the wait has lasted :data:`STAND_IN_S` (a wait
    that ends sooner costs the store nothing), then again after a gap that doubles up to 8 s while it is
    not there (as :meth:`~distribute_utils.incarnation.PeerDirectory.local_peers` backs off: every process
    of a job may be waiting); once per round however many waits of the process share it. A look is a
    ``check``, then a ``get`` once it is there (a ``compare_set`` would read it in one round trip, but
    wakes the waiters of a key that is not there, which then read nothing). It posts with ``compare_set``
    (never over a value the rank posted); ``posted`` tells the waiter that the key is its to collect.
    """

    __slots__ = ("gap", "key", "make", "next_look", "posted", "settled", "source")

    def __init__(self, source: str, key: str, make: Callable[[bytes], bytes | None]) -> None:
        self.source, self.key, self.make = source, key, make
        self.next_look = time.monotonic() + STAND_IN_S  # (monotonic seconds)
        self.gap = STAND_IN_S  # until the look after the next one
        self.settled = False  # the rank said it posts the key itself
        self.posted = False  # the watchdog posted make's value in its place


class Watch:
    """One wait in progress: the keys a rank waits on, and whose death would fill them.

    ``awaited`` maps a rank to the key its death must fill (with :data:`TOMBSTONE` plus its
    rank number; only its ``get`` is used, for this host's ranks); ``arrived`` (for barriers) tells,
    through the watch's store, whether the rank had arrived first; ``stand_in``: see :class:`StandIn`.
    """

    def __init__(
        self,
        source: PeerDirectory,
        store: dist.Store,
        awaited: Mapping[int, str],
        arrived: Callable[[dist.Store, int], bool] | None,
        stand_in: StandIn | None = None,
    ) -> None:
        self.source, self.store, self.awaited, self.arrived = source, store, awaited, arrived
        self.stand_in = stand_in
        self.since = time.monotonic()


class Watchdog:
    """One daemon thread per process that tombstones what dead local peers never posted."""

    def __init__(self) -> None:
        self._forked()
        self._closed = False
        self._fork_hook = False

    def _hook_fork(self) -> None:
        """A child starts without the thread (registered by the first :meth:`add`: before it, there is
        nothing to reset; registered twice by a race, the reset runs twice, harmlessly)."""
        if not self._fork_hook:
            self._fork_hook = True
            os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watches: dict[int, Watch] = {}
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether its thread runs in this process (a forked child has none until its first :meth:`add`)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """End the thread (at exit: never leave it inside a store call, see :class:`Janitor`)."""
        with self._lock:
            self._closed = True
            self._watches.clear()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)

    def add(self, watch: Watch) -> int:
        self._hook_fork()
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

    def watching(self, watch: Watch) -> bool:
        """Whether ``watch`` is still registered (its wait has not ended)."""
        with self._lock:
            return self._watches.get(id(watch)) is watch

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
            due = [w for w in watches if now - w.since >= GRACE_S]
            if due:
                self.check_round(due)
                time.sleep(WATCH_INTERVAL_S)
            else:
                oldest = min(w.since for w in watches)
                time.sleep(max(0.0, GRACE_S - (now - oldest)))

    def check_round(self, due: Sequence[Watch]) -> int:
        """One round of checks of the waits ``due``; returns the processes looked at (for tests).

        The work per round does not grow with the number of waits of one source (threads waiting on
        different groups of one process share its :class:`PeerDirectory`): each source's local peers
        are read and each process is looked at once; a wait costs one more grouping step, and
        something more only when a peer it awaits is dead. A wait that ended since the round began is
        skipped (its keys are not touched).
        """
        by_source: dict[int, list[Watch]] = {}
        for watch in due:
            by_source.setdefault(id(watch.source), []).append(watch)
        alive: dict[ProcessInfo, bool] = {}  # each process looked at once per round of checks
        for watches in by_source.values():
            if not any(self.watching(w) for w in watches):
                continue  # every wait of it ended since the round began
            try:
                peers = watches[0].source.local_peers()  # (a few: not every rank a wait awaits)
                dead = []
                for rank, info in peers.items():
                    found = alive.get(info)
                    if found is None:
                        found = alive[info] = process_alive(info)
                    if not found:
                        dead.append(rank)
                for watch in watches if dead else ():
                    if self.watching(watch):  # (not a wait that ended meanwhile)
                        for rank in dead:
                            self._tombstone(watch, rank)
            except Exception:  # the store may be gone: the waiter will say so
                logger.debug("watchdog check failed", exc_info=True)
        self._stand_ins(due)
        return len(alive)

    def _stand_ins(self, due: Sequence[Watch]) -> None:
        """Post what stands in for the awaited ranks of ``due`` waits that said they will not post (see
        :class:`StandIn`): each source read and made once per round, and the lock held once (the waits of
        one process, thousands in a simulation, take it too as they come and go)."""
        now = time.monotonic()
        waiting = [
            w
            for w in due
            if (s := w.stand_in) is not None and not (s.settled or s.posted) and now >= s.next_look
        ]
        if not waiting:
            return
        with self._lock:
            waiting = [w for w in waiting if self._watches.get(id(w)) is w]  # (not a wait that ended)
        said: dict[str, tuple[bool, bytes | None]] = {}  # source: (there, what stands in)
        for watch in waiting:
            stand_in = watch.stand_in
            assert stand_in is not None
            try:
                found = said.get(stand_in.source)
                if found is None:
                    found = said[stand_in.source] = (False, None)  # (a read that fails is not tried again)
                    there = watch.store.check([stand_in.source])
                    made = stand_in.make(watch.store.get(stand_in.source)) if there else None
                    found = said[stand_in.source] = (there, made)
                there, made = found
                if not there:  # not said yet (or not read): look again after the gap, doubled
                    stand_in.next_look = now + stand_in.gap
                    stand_in.gap = min(2 * stand_in.gap, _STAND_IN_MAX_S)
                    continue
                if made is None:
                    stand_in.settled = True
                    continue
                stand_in.posted = True  # (before the post: the waiter wakes on it)
                try:
                    watch.store.compare_set(stand_in.key, b"", made)  # type: ignore[arg-type]  # torch's stub: compare_set takes bytes too
                except Exception:
                    stand_in.posted = False  # (the next round tries again)
                    raise
            except Exception:  # the store may be gone: the waiter will say so
                logger.debug("watchdog stand-in failed", exc_info=True)

    @staticmethod
    def _tombstone(watch: Watch, rank: int) -> None:
        """Post the tombstone of ``rank`` (dead) in the key ``watch`` awaits of it, if it awaits one."""
        key = watch.awaited.get(rank)
        if key is None:
            return
        if watch.arrived is not None and watch.arrived(watch.store, rank):
            return  # it arrived, then exited: not what anybody waits for
        watch.store.compare_set(key, b"", TOMBSTONE + str(rank).encode())  # type: ignore[arg-type]  # torch's stub: compare_set takes bytes too


WATCHDOG = Watchdog()


class Janitor:
    """Deletes keys of finished calls off the critical path, on its own store clients.

    Stopped and joined at interpreter exit: a daemon thread still inside a store call while
    the interpreter tears down makes the process abort ("terminate called without an active
    exception"), so the queue is drained first (bounded to a few seconds). It never connects
    to a store that nobody holds any more, or whose server no longer answers (a new client
    would retry for the store's whole timeout): their keys go with them.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[weakref.ref[dist.Store], list[str]] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._clients: weakref.WeakKeyDictionary[dist.Store, dist.Store] = weakref.WeakKeyDictionary()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def delete(self, store: dist.Store, keys: list[str]) -> None:
        if self._stopped or not keys:
            return
        if self._thread is None or not self._thread.is_alive():
            atexit.register(self.stop)  # as the watchdog: registered after torch's, so it runs first
            self._thread = threading.Thread(target=self._run, name="distribute-utils-janitor", daemon=True)
            self._thread.start()
        self._queue.put((weakref.ref(store), keys))

    @property
    def running(self) -> bool:
        """Whether its thread runs (started by the first :meth:`delete` with keys)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def clients(self) -> int:
        """How many store clients of its own it holds (one per store it deleted keys of)."""
        return len(self._clients)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the deletions queued so far are done (whether each
        succeeded or not); False when they were not. For benchmarks that time calls one after another
        (``scripts/bench_sync_scale.py``), so that one call's deletions do not land in the next."""
        if self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

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
            if isinstance(item, threading.Event):
                item.set()
                continue
            self.delete_now(*item)

    def delete_now(self, store_ref: weakref.ref[dist.Store], keys: list[str]) -> None:
        """Delete ``keys`` of the store ``store_ref`` refers to, on the calling thread: what the janitor's
        thread does with each deletion :meth:`delete` queues. Called directly by tests only, on a janitor
        whose thread does not run (its clients are not locked)."""
        store = store_ref()  # (held only during the call: a store the job dropped is not kept alive)
        if store is None:
            return
        try:
            client = self._clients.get(store)
            if client is None:
                # At exit, or with the store's server gone: never a new connection (nor a long one).
                if self._stopped:
                    return
                client = self._clients[store] = new_client(store, "deleting keys", _JANITOR_CONNECT_S)
            for key in keys:
                client.delete_key(key)
        except Exception:  # the job is ending or the store is gone: nothing to clean
            logger.debug("could not delete %d keys", len(keys), exc_info=True)


JANITOR = Janitor()


def wait_watched(
    store: dist.Store,
    keys: list[str],
    ranks: Sequence[int],
    timeout: float,
    what: str,
    watch: Watch | None,
    generation: Callable[[int], int | None] | None = None,
    mine: int | None = None,
    tombstones: bool = True,
) -> list[bytes]:
    """Values of ``keys`` (posted by ``ranks``, one each), waiting at most ``timeout`` seconds, while the
    watchdog checks the peers of ``watch`` (when given).

    With ``tombstones`` (the default), a value the watchdog posted for a dead rank raises.

    Raises:
        PeerLostError: some of ``ranks`` did not post in time, or died (named), or the store
            itself is gone.
    """
    if not keys:
        return []
    ident = WATCHDOG.add(watch) if watch is not None else 0
    try:
        values = wait_values(store, keys, ranks, timeout, what, generation, mine)
    finally:
        if ident:
            WATCHDOG.remove(ident)
    dead = [r for r, v in zip(ranks, values) if v.startswith(TOMBSTONE)] if tombstones else []
    if dead:
        raise PeerLostError(f"{what}: rank(s) {dead} exited while this rank was waiting for them", dead)
    return values


def exited(what: str, dead: dict[int, int], store: dist.Store) -> PeerLostError:
    """``dead`` (rank: pid) exited while this rank waited for them without the store (a direct round):
    when one of them hosted the store, its server is gone too, and the error says so (naming both)."""
    ranks = list(dead)
    message = f"{what}: rank(s) {ranks} exited while this rank was waiting for them"
    await_last_threads(dead.values())
    refused = refusal(store)
    if not isinstance(refused, ConnectionRefusedError):
        return PeerLostError(message, ranks)
    return store_gone(message, store, refused, ranks)


def await_last_threads(pids: Iterable[int], limit: float = _EXIT_S) -> None:
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
