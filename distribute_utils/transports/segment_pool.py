"""Internal. The sender's pooled shared-memory segments, and the receivers' word that they are free again.

:class:`SegmentPool` keeps a sender's warm segments (one pool per default process group, closed with
it: :func:`distribute_utils.owners.owned`); a receiver that lets a segment go tells its sender at once
through the sender's notice socket (:class:`Notices`), or, when it cannot, keeps a report
(:class:`FreedReports`) that the round carries to the sender in a later verdict. Reports and notices
name processes and segments, never ranks, so they outlive the group they were made in: both are
process-wide (:func:`distribute_utils.owners.process_owned`), and so is the registry of pools
(:class:`Pools`): a closed pool whose segments a receiver still maps stays there, *retiring*, until
they are reported free (the next group starts with a pool of its own, empty).

Call order: the carrier (:class:`.shm.SharedMemoryTransport`) takes, fits and writes segments;
the round hands reports over with :data:`.carriers.reports`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import host_dir
from ..caches import Recent
from ..errors import SpaceError
from ..mailbox import ANCILLARY_SIZE, sender_pid
from ..owners import process_owned
from ..processes import SHM_DIR, ProcessInfo, process_alive
from ..wire import EncodedPayload
from .files import reserve_space
from .pinning import Registration

__all__ = [
    "NOTICE_NAME",
    "BigSegmentWatch",
    "FreedReports",
    "Idle",
    "Notices",
    "Pools",
    "Segment",
    "SegmentPool",
    "heed_notices",
    "reserve",
    "shm_space",
]

logger = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_TRUNCATED = int(socket.MSG_TRUNC)


def shm_space() -> tuple[int, int]:
    """``(size, free bytes)`` of ``/dev/shm``."""
    st = os.statvfs(SHM_DIR)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def reserve(fd: int, nbytes: int, rank: int) -> None:
    """Allocate every page of a new segment now, so a full /dev/shm fails here, cleanly (never a SIGBUS
    later): :func:`.files.reserve_space`, with the answer a full ``/dev/shm`` deserves."""
    try:
        if not reserve_space(fd, nbytes):  # tmpfs has fallocate(2); glibc's emulation otherwise
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            size, free = shm_space()
            raise SpaceError(
                errno.ENOSPC,
                f"{SHM_DIR} (size {size:,} bytes, {free:,} free now) cannot hold the "
                f"{nbytes:,} bytes of rank {rank}'s payload; enlarge {SHM_DIR} "
                "(e.g. docker --shm-size) or pass a workspace_path",
            ) from None
        raise


@dataclass
class Segment:
    """A pooled segment: an unnamed file in ``/dev/shm`` whose pages stay allocated."""

    ident: str
    fd: int
    inode: int
    size: int = 0
    busy: bool = True
    drop_when_freed: bool = False
    receiver: ProcessInfo | None = None  # who maps it while busy (a dead one never frees it)
    looked: float = 0.0  # when it was last taken, or its receiver last found alive (time.monotonic)
    needed: float = 0.0  # when a payload of over half its size last went into it (time.monotonic)
    needed_at: int = 0  # the sender's payload count then (see SegmentPool.note_payload)
    written: bool = False  # once: the next payloads are copied into a map (see write)
    mapped: mmap.mmap | None = None  # the sender's own shared map of it, from its second payload on
    pinned: Registration | None = None  # ``mapped``, registered with CUDA (from its first GPU payload)
    pin_tried: bool = False

    def write(self, payload: EncodedPayload) -> None:
        """Copy ``payload`` in. The first payload goes with ``pwrite`` (the kernel fills the new pages
        directly; a first touch through a map would zero each page before the copy: 1.6x slower at
        64 MiB); then the segment is mapped, every page at once (``MAP_POPULATE``), and later payloads
        are plain copies into the map, up to twice as fast as ``pwrite``, which looks up every page.
        A payload with tensors on a GPU is copied from there into the map (mapped now if need be),
        registered with CUDA the first time, so that the copies run at pinned speed."""
        if (self.written or payload.on_device) and self.mapped is None:
            try:
                self.mapped = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
            except OSError as exc:  # e.g. out of address space: pwrite needs none (tried again next time)
                if payload.on_device:
                    raise
                logger.debug("pooled segment %s written with pwrite: %s", self.ident, exc)
        if payload.on_device and not self.pin_tried:
            self.pin_tried = True
            self.pinned = Registration.of(self.mapped, self.size)
        if self.mapped is not None:
            payload.write_into(self.mapped)
        else:
            payload.write_to_fd(self.fd)
        self.written = True

    def close(self) -> None:
        """Unregister and close the sender's map, and its descriptor (the pages go once no receiver maps
        them either)."""
        try:
            if self.pinned is not None:
                self.pinned.close()
            if self.mapped is not None:
                self.mapped.close()
        finally:
            os.close(self.fd)


class SegmentPool:
    """Each sender's warm segments, reused once the receiver's views of them are gone (the carriers'
    pool: ``owned(SegmentPool)``, one per default process group; :meth:`close` retires it).

    Allocating fresh tmpfs pages costs more than copying into them (64 MiB here: 22 ms into a fresh
    segment, 10 ms into a warm one through the sender's map; ``scripts/bench_gather.py
    --write-costs``). A large payload therefore goes into one of at most
    :attr:`LIMIT` pooled segments: ``O_TMPFILE`` files in ``/dev/shm`` that never have a name,
    so nothing is ever visible there and the kernel frees them when the process exits, however
    it exits. The receiver opens one through ``/proc/<sender pid>/fd/<fd>`` (checking its
    inode), maps it (shared), and the segment stays *busy* until the receiver reports that
    its views are gone (a weak reference's callback sends the report to the sender's notice socket,
    :class:`Notices`; when it cannot, :class:`FreedReports` keeps the report for the round,
    which carries it to the sender in the verdict of the next gather they share, relayed by the first
    rank when a host's leader let the segment go); only then is it written again. A
    segment is pooled only while ``/dev/shm`` keeps at least four times its size free, and never
    resized once sent: its receiver may keep its map (:class:`KeptMaps`).
    """

    LIMIT = 2
    MIN_BYTES = 64 * 2**10
    # A free segment is released once it is larger than twice the largest of the last RECENT payloads
    # that went to shared memory (``pooled``: not in a claim message), or of the last RECENT_ANY payloads
    # of any size: small payloads between large ones (a model's scales between its weights) do not push
    # out a segment that the next weight needs, yet a large gather followed only by small ones does not
    # keep its segment.
    RECENT = 8
    RECENT_ANY = 64
    # The bound on what a process keeps while it does not need it: a free segment of over BIG_BYTES is
    # given back once none of the sender's last KEEP_PAYLOADS payloads, or none in the last KEEP_S
    # seconds, needed it (over half its size): at a send, or, in a process that sends no more, by a
    # thread that looks every KEEP_S / 2 seconds while such a segment is held (see BigSegmentWatch).
    # So an idle process keeps at most LIMIT segments of at most BIG_BYTES each.
    BIG_BYTES = 64 * 2**20
    KEEP_PAYLOADS = 8
    KEEP_S = 5.0
    LOOK_EVERY_S = 1.0  # a busy segment's receiver is looked up at most this often (a /proc read)

    def __init__(self) -> None:
        self._pools = process_owned(Pools)  # (the process's: kept, no lookup per send)
        self._pools.every.add(self)  # a forked child closes its copies of every pool's segments
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._recent: collections.deque[int] = collections.deque(maxlen=self.RECENT)
        self._recent_any: collections.deque[int] = collections.deque(maxlen=self.RECENT_ANY)
        self._payloads = 0  # payloads noted so far
        self.closed = False

    def close(self) -> None:
        """The group that owned this pool is gone: free segments are given back now, and no segment is
        taken any more; busy ones go as their receivers free them (meanwhile the pool is retiring,
        process-wide, so that notices and reports still reach it: see :class:`Pools`)."""
        self.closed = True
        self.release()
        if self.held()[0]:
            self._pools.retiring.add(self)

    def note_payload(self, nbytes: int, pooled: bool) -> None:
        """A sender's payload size, pooled or not: segments much larger than what recent rounds
        sent are given back (a 1 GiB gather followed by small ones does not pin 1 GiB; see
        :attr:`RECENT`), and so are busy ones whose receiver died (it never reports them freed;
        looked up once a second). ``pooled``: the payload goes to shared memory, not in a message."""
        self._recent_any.append(nbytes)  # (bounded deques: one step each under the GIL)
        self._payloads += 1
        if pooled:
            self._recent.append(nbytes)
        retiring = self._pools.retiring
        if not self._segments and not retiring:
            return
        heed_notices(self)
        bound = 2 * min(max(self._recent, default=0), max(self._recent_any))
        for pool in (self, *retiring):
            pool._drop_unneeded(bound)

    def _drop_unneeded(self, bound: int) -> None:
        """Give back free segments larger than ``bound`` or big and unneeded (see :attr:`BIG_BYTES`),
        and busy ones whose receiver died."""
        with self._lock:
            now = time.monotonic()
            dropped = [
                s
                for s in self._segments.values()
                if (s.size > bound or self._idle(s, now) if not s.busy else self._receiver_gone(s, now))
            ]
            for seg in dropped:
                del self._segments[seg.ident]
        for seg in dropped:
            seg.close()
        self._retired_when_empty()

    def _idle(self, seg: Segment, now: float) -> bool:
        """Whether ``seg`` is big and no recent payload needed it (see :attr:`BIG_BYTES`)."""
        return seg.size > self.BIG_BYTES and (
            self._payloads - seg.needed_at > self.KEEP_PAYLOADS or now - seg.needed > self.KEEP_S
        )

    def drop_idle(self) -> bool:
        """Give back the free big segments no recent payload needed (:attr:`BIG_BYTES`), and busy ones
        whose receiver died, after reading the notices that came; True while it still holds a big
        segment (any thread)."""
        heed_notices(self)
        with self._lock:
            now = time.monotonic()
            dropped = [
                s
                for s in self._segments.values()
                if (self._receiver_gone(s, now) if s.busy else self._idle(s, now))
            ]
            for seg in dropped:
                del self._segments[seg.ident]
            big = any(s.size > self.BIG_BYTES for s in self._segments.values())
        for seg in dropped:
            seg.close()
        self._retired_when_empty()
        return big

    def _retired_when_empty(self) -> None:
        if self.closed and not self._segments:
            self._pools.retiring.discard(self)

    def _receiver_gone(self, seg: Segment, now: float) -> bool:
        if seg.receiver is None or now - seg.looked < self.LOOK_EVERY_S:
            return False
        seg.looked = now
        return not process_alive(seg.receiver)

    def release(self) -> int:
        """Give back every free segment; busy ones go when their receiver frees them.

        Returns:
            The bytes given back now.
        """
        heed_notices(self)
        with self._lock:
            free = [s for s in self._segments.values() if not s.busy]
            for seg in free:
                del self._segments[seg.ident]
            for seg in self._segments.values():
                seg.drop_when_freed = True
        for seg in free:
            seg.close()
        return sum(s.size for s in free)

    def held(self) -> tuple[int, int]:
        """``(segments, bytes)`` this process's pool holds in ``/dev/shm``."""
        with self._lock:
            return len(self._segments), sum(s.size for s in self._segments.values())

    @property
    def segments(self) -> dict[str, Segment]:
        """Its segments by ident (the third field of a receipt), oldest first: a copy, to look at."""
        with self._lock:
            return dict(self._segments)

    def take(self, nbytes: int) -> Segment | None:
        """A free pooled segment (marked busy), a new one, or None to use a fresh named one."""
        if nbytes < self.MIN_BYTES or not hasattr(os, "O_TMPFILE") or self.closed:
            return None
        if self._segments and not self._fits(nbytes):  # a notice since the last send may free one
            heed_notices(self)
        with self._lock:
            if self.closed:  # (closed since the look above: a segment made now would never be given back)
                return None
            free = [seg for seg in self._segments.values() if not seg.busy]
            fitting = [seg for seg in free if seg.size >= nbytes]
            if fitting:  # the best fit: the smallest that holds it, its pages already touched
                seg = min(fitting, key=lambda s: s.size)
                if seg.size < 2 * nbytes:
                    seg.needed, seg.needed_at = time.monotonic(), self._payloads
            else:
                if len(self._segments) >= self.LIMIT:
                    if not free:
                        return None
                    # Never grown: a receiver may keep its map (only while the segment is small).
                    victim = self._segments.pop(min(free, key=lambda s: s.size).ident)
                    victim.close()
                if shm_space()[1] < 4 * nbytes:
                    return None
                fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
                seg = Segment(secrets.token_hex(8), fd, os.fstat(fd).st_ino)
                seg.needed, seg.needed_at = time.monotonic(), self._payloads
                self._segments[seg.ident] = seg
            seg.busy, seg.looked = True, time.monotonic()
        if nbytes > self.BIG_BYTES:
            process_owned(BigSegmentWatch).start()
        return seg

    def _fits(self, nbytes: int) -> bool:
        with self._lock:
            return any(not seg.busy and seg.size >= nbytes for seg in self._segments.values())

    def fit(self, seg: Segment, nbytes: int, rank: int) -> None:
        """Make ``seg`` hold at least ``nbytes``, its pages reserved: a new segment is sized here, once
        (it never shrinks: a smaller payload would give back pages that the next large one must fault
        in again; nor grows: see :meth:`take`)."""
        if seg.size < nbytes:
            reserve(seg.fd, nbytes, rank)
            seg.size = nbytes

    def freed(self, idents: set[str]) -> None:
        """The receivers' maps of these segments are gone: they may be written again."""
        dropped = []
        with self._lock:
            for ident in idents:
                seg = self._segments.get(ident)
                if seg is not None:
                    seg.busy = False
                    if seg.drop_when_freed:
                        dropped.append(self._segments.pop(ident))
        for seg in dropped:
            seg.close()
        if dropped:
            self._retired_when_empty()

    def heed(self, notices: Collection[tuple[int, str]]) -> list[tuple[int, str]]:
        """Free the segments of these notices ``(receiver pid, segment id)``: each from the process the
        segment was lent to (any process of this user when that was not said). Returns the notices that
        name none of its segments (another pool's)."""
        if not notices:
            return []
        others = []
        with self._lock:
            idents = set()
            for pid, ident in notices:
                seg = self._segments.get(ident)
                if seg is None:
                    others.append((pid, ident))
                elif seg.receiver is None or seg.receiver.pid == pid:
                    idents.add(ident)
        self.freed(idents)
        return others

    def drop(self, ident: str) -> None:
        """Forget segment ``ident`` (its receiver may still map it; the kernel frees it later)."""
        with self._lock:
            seg = self._segments.pop(ident, None)
        if seg is not None:
            seg.close()
            self._retired_when_empty()

    def discard(self, seg: Segment) -> None:
        """Drop ``seg`` from the pool (after a failed publish)."""
        with self._lock:
            self._segments.pop(seg.ident, None)
        seg.close()

    def forked(self) -> None:
        """A forked child must never write its parent's segments: it closes its copies of them."""
        segments, self._segments, self._lock = self._segments, {}, threading.Lock()
        for seg in segments.values():
            with contextlib.suppress(BufferError, OSError):  # (a parent's thread was copying into it)
                seg.close()


NOTICE_NAME = re.compile(r"[0-9a-f]{16}")


def _notice_socket(pid: int, name: str) -> str:
    """The socket name of process ``pid``'s notice socket ``name`` in this user's private directory
    (:mod:`..host_dir`; named after its process, as every socket there is)."""
    return f"{int(pid)}-freed-{name}"


class Notices:
    """This process's socket for "freed" notices, as a sender of pooled segments, and its socket for
    sending them, as a receiver (process-wide: ``process_owned(Notices)``).

    A receiver's report that its views of a segment are gone otherwise reaches the sender in the
    verdict of their next gather: a round late, so meanwhile the sender writes its other segment, and
    keeps two. So a receiver sends the report straight here when it can (a Unix datagram socket in
    this user's private directory, :mod:`..host_dir`, named in the receipt), and keeps it for a
    verdict only when it cannot: each report goes
    one way, never twice. The sender reads its notices, never waiting, at every send
    (:meth:`SegmentPool.note_payload`), when no free segment fits a payload, and when it releases its
    pool; it heeds one only from the process the segment was lent to (the kernel names a datagram's
    sender).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._name = ""
        self._path = ""
        self._tried = False
        self._tellers = host_dir.Connections()  # for sending notices: connected to the senders' sockets
        self._paths: Recent[tuple[int, str], str] = Recent(256)  # (their paths)

    def name(self) -> str:
        """The name of this process's notice socket, for its receipts ("" when it cannot listen)."""
        if not self._tried:
            with self._lock:
                if not self._tried:
                    self._listen()
                    self._tried = True
        return self._name

    def _listen(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            name = secrets.token_hex(8)
            path = host_dir.bind(sock, _notice_socket(os.getpid(), name))
        except OSError as exc:
            sock.close()
            logger.debug("pooled segments are reported freed in verdicts only: %s", exc)
            return
        self._sock, self._name, self._path = sock, name, path
        atexit.register(self.close)

    def close(self) -> None:
        """Stop listening and remove the socket's file (at exit; a forked child's copy is closed by
        :meth:`forked`, its file left to the parent)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            host_dir.unbind(self._path)

    def take(self) -> list[tuple[int, str]]:
        """``(receiver pid, segment id)`` of the notices that came (never waits)."""
        found: list[tuple[int, str]] = []
        sock = self._sock
        if sock is None:
            return found
        uid = os.geteuid()
        while True:
            try:
                data, ancillary, flags, _ = sock.recvmsg(64, ANCILLARY_SIZE)
            except OSError:  # none left (or closed)
                return found
            pid = sender_pid(ancillary, uid)
            if pid is not None and not flags & _TRUNCATED:
                found.append((pid, data.decode("ascii", "replace")))

    def tell(self, notice: str, pid: int, ident: str) -> bool:
        """Send the notice that this process's views of segment ``ident`` are gone to the socket ``notice``
        of its sender, process ``pid``; False when there is none or it cannot take it now (the report
        then goes in a verdict)."""
        if not notice:
            return False
        path = self._paths.get((pid, notice))
        if path is None:
            path = self._paths.put((pid, notice), host_dir.socket_path(_notice_socket(pid, notice)))
        try:  # (any thread may tell: a race closes a kept socket under another's send, which then fails)
            return self._tellers.send(path, [ident.encode()])
        except OSError:
            return False

    def forked(self) -> None:
        """A forked child must not read its parent's notices: it closes its copy (no shutdown)."""
        if self._sock is not None:
            self._sock.close()
        self._tellers.close()
        self._lock, self._sock, self._name, self._tried = threading.Lock(), None, "", False


class Pools:
    """Every segment pool of this process (process-wide: ``process_owned(Pools)``): :attr:`every` (one
    per group in use, more in tests), of which :attr:`retiring` those closed with segments still busy
    (held here until their receivers free them). A forked child closes its copies of all of them."""

    def __init__(self) -> None:
        self.every: weakref.WeakSet[SegmentPool] = weakref.WeakSet()
        self.retiring: set[SegmentPool] = set()

    def __iter__(self) -> Iterator[SegmentPool]:
        return iter(list(self.every))

    def forked(self) -> None:
        for pool in self:
            pool.forked()
        self.retiring.clear()


class Idle(Protocol):
    """What :class:`BigSegmentWatch` looks after besides the pools: a holder of big shared memory that
    gives back what is no longer needed when asked (any thread)."""

    def drop_idle(self) -> bool:
        """Give back what is idle; True while something big is still held."""
        ...


class BigSegmentWatch:
    """Gives back big shared memory in a process that no longer gathers (process-wide:
    ``process_owned(BigSegmentWatch)``): a daemon thread that, while any pool holds a segment of over
    :attr:`SegmentPool.BIG_BYTES` or a watched holder (:meth:`watch`: a first rank's kept maps of
    segments over 4 MiB) still holds something, calls their ``drop_idle`` every ``KEEP_S / 2`` seconds; it
    ends when none is left (started again by the next big payload or watched map) and at exit. (A first
    rank whose senders keep their segments keeps its maps, so its watch runs as long: a look every 2.5 s.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wanted = False  # a big segment or map came since the thread last looked
        self._holders: weakref.WeakSet[Idle] = weakref.WeakSet()
        self._stop = threading.Event()
        atexit.register(lambda: self._stop.set())  # (the child's own after a fork: see forked)

    def start(self) -> None:
        """A big segment was taken: make sure the thread runs."""
        with self._lock:
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="distribute-utils-pool-watch", daemon=True
                )
                self._thread.start()

    def watch(self, holder: Idle) -> None:
        """``holder`` took something big: ask it too (until it says it holds nothing big), and make
        sure the thread runs. (Not from a weakref callback: it may start a thread.)"""
        with self._lock:
            self._holders.add(holder)
        self.start()

    def watching(self, holder: Idle) -> bool:
        """Whether ``holder`` is asked (until it says it holds nothing big)."""
        with self._lock:
            return holder in self._holders

    @property
    def running(self) -> bool:
        """Whether its thread runs."""
        return self._thread is not None

    def _run(self) -> None:
        try:
            self._look_until_idle()
        except Exception:  # (a failed look must not leave the watch marked running: start runs it again)
            logger.warning("the big shared memory watch stopped", exc_info=True)
            with self._lock:
                self._thread = None

    def _look_until_idle(self) -> None:
        while not self._stop.wait(SegmentPool.KEEP_S / 2):
            with self._lock:
                self._wanted = False
                holders = list(self._holders)
            held = False
            for pool in process_owned(Pools):
                held = pool.drop_idle() or held
            idle = []
            for holder in holders:
                if holder.drop_idle():
                    held = True
                else:
                    idle.append(holder)
            with self._lock:
                if self._wanted:  # (taken since the look: an idle holder may hold it; asked again)
                    continue
                for holder in idle:
                    self._holders.discard(holder)
                if not held:
                    self._thread = None
                    return

    def forked(self) -> None:
        """A forked child starts without the thread (its parent's pools are closed there, and its kept
        maps forgotten: :meth:`.kept_maps.KeptMaps.forked`)."""
        self._lock, self._thread, self._wanted, self._stop = threading.Lock(), None, False, threading.Event()
        self._holders = weakref.WeakSet()


def heed_notices(first: SegmentPool | None = None) -> None:
    """Read this process's notices (never waits) and free the segments they name, in whichever pool
    holds them (a retiring one included): ``first``'s (the caller's own pool) before the others, which
    are looked up only for the notices it does not hold."""
    notices = process_owned(Notices).take()
    if notices and first is not None:
        notices = first.heed(notices)
    if notices:
        for pool in process_owned(Pools):
            if pool is not first:
                notices = pool.heed(notices)


class FreedReports:
    """This process's reports, as a receiver, that its views of other processes' pooled segments are
    gone, for the senders its notice could not reach (see :class:`Notices`): the round carries them
    in its claims and verdicts, each once. Reports name processes, not ranks (a rank number may belong
    to another process by the time a report travels: the default group was made anew); as they travel
    they are ``[rank, segment id, pid]`` ("notes"). One per process: ``process_owned(FreedReports)``
    (:data:`.shm.REPORTS`).
    """

    def __init__(self) -> None:
        self._freed: set[tuple[int, str]] = set()  # (sender pid, segment id)

    def add(self, report: tuple[int, str]) -> None:
        """A view of segment ``report[1]`` of process ``report[0]`` is gone (any thread)."""
        self._freed.add(report)

    def pending(self) -> bool:
        """Whether any report waits (cheap; ask before looking up the senders)."""
        return bool(self._freed)

    def take(self, senders: Mapping[int, int]) -> list[list[Any]]:
        """The receiver, when done: the reports for ``senders`` (their pid -> their rank now, processes
        of this pid namespace), as notes. Each report is handed out once: deliver it, or :meth:`keep` it."""
        if not self._freed:  # the common case: nothing to look up in a list that may hold thousands of ranks
            return []
        found = [item for item in list(self._freed) if item[0] in senders]
        for item in found:
            self._freed.discard(item)
        return [[senders[pid], ident, pid] for pid, ident in found]

    def keep(self, notes: Collection[Sequence[Any]]) -> None:
        """Take back notes from :meth:`take` that were not delivered (for a later gather)."""
        self._freed.update((pid, ident) for _, ident, pid in notes)

    @staticmethod
    def heed(rank: int, notes: Sequence[Any]) -> None:
        """A sender ``rank``, given its receiver's notes: its segments named there may be written again."""
        if notes:
            idents = {n[1] for n in notes if type(n) is list and len(n) == 3 and n[0] == rank}
            for pool in process_owned(Pools):  # the group's pool, or one retiring
                pool.freed(idents)
