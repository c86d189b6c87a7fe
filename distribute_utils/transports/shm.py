"""Shared-memory transport: one POSIX segment per sender and round, mapped zero-copy.

Segment ``/dev/shm/du_<token>_<rank>_<pid>``: ``token`` is unguessable and fresh per round
(so two jobs, or a crashed run's leftovers, never collide), ``pid`` is the sender's, so
``distribute-utils clean`` can tell a dead owner's segment. Mode 0600.

- ``publish`` creates the segment exclusively, reserves its exact size with
  ``posix_fallocate`` (a full ``/dev/shm`` gives :class:`SpaceError` naming the size needed
  and the space free, never a SIGBUS later), then ``pwrite``s the payload into it. Large
  payloads reuse warm pooled segments (see :class:`SegmentPool`), copied into the sender's own
  map of them (:meth:`_Segment.write`). Tensors on a GPU are copied from there straight into the
  segment, once: a pooled segment is registered with the CUDA runtime (:mod:`.pinning`) the first
  time a GPU payload goes into it, and stays registered while pooled, so the copy runs at pinned speed.
- ``fetch`` maps the segment copy-on-write, unlinks its name at once and returns the map:
  decoded tensors are views of it, valid for as long as they live. A pooled segment is mapped
  shared instead (nobody else reads it until its receiver lets it go), and a small one's map is
  kept for its next payload (see :class:`KeptMaps`). A first rank that copies what it receives to
  a GPU (``pin=True``) registers its map of a pooled segment once and keeps it, whatever its size.
- ``release`` unlinks the sender's segment if the first rank never took it.

No ``multiprocessing.shared_memory``: nothing is registered with the resource tracker.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import interrupts
from ..errors import PayloadError, PeerLostError, SpaceError
from ..mailbox import ANCILLARY_SIZE, sender_pid
from ..processes import SHM_DIR, ProcessInfo, process_alive
from ..wire import EncodedPayload, stated_length
from .base import Context
from .files import reserve_space, unlink
from .pinning import Registration

__all__ = [
    "REPORTS",
    "SEGMENT_PREFIX",
    "FreedReports",
    "KeptMaps",
    "SegmentMap",
    "SegmentPool",
    "SharedMemoryTransport",
    "kept_maps",
    "pooled_bytes",
    "release_shared_memory",
    "remove_segments_of",
    "segment_path",
]

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "du_"


def segment_path(token: str, rank: int, pid: int) -> str:
    """Path of the segment ``rank`` (process ``pid``) publishes in round ``token``."""
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{token}_{rank}_{pid}")


def shm_space() -> tuple[int, int]:
    """``(size, free bytes)`` of ``/dev/shm``."""
    st = os.statvfs(SHM_DIR)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


class SharedMemoryTransport:
    """The segment carrier: moves payloads through ``/dev/shm`` between ranks of one host; implements
    :class:`.base.Carrier` (kind ``"shm"``).

    Receipts (what ``publish`` returns, carried to the receiver in the sender's claim) say
    where the payload is: ``n:<pid>:<nbytes>`` for a named segment, or
    ``p:<pid>:<id>:<fd>:<inode>:<nbytes>:<notice>`` for a pooled one (``notice``: where the
    receiver tells the sender at once that its views are gone, see :class:`_Notices`; may be empty).
    A pooled segment's receiver that cannot tell it so keeps a report for the round to carry
    (:attr:`reports`, :class:`FreedReports`).

    Args:
        pool: publish payloads of :attr:`SegmentPool.MIN_BYTES` or more from this process's
            warm pooled segments (True), or from the given pool; only when the receiver shares this
            process's pid namespace (it opens them through ``/proc/<pid>/fd``).
        receiver: the receiving process: a pooled segment it still maps is given back once
            it has died (it will never report the segment freed).
        pin: the receiving side copies what it fetches to a GPU: its maps of pooled segments are
            registered with the CUDA runtime (once each, kept between rounds).
    """

    kind = "shm"
    done_when_answered = False
    pooling = True
    """False: every segment is a named one, whatever ``pool`` says (a documented seam for tests of
    named segments: a dead sender's pooled segment dies with it)."""
    reports: FreedReports  # (set below: this process's, one for every instance)

    def __init__(
        self, pool: bool | SegmentPool = False, receiver: ProcessInfo | None = None, pin: bool = False
    ) -> None:
        self._pool = _POOL if pool is True else pool or None
        self._receiver = receiver
        self._pin = pin

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> SharedMemoryTransport:
        return cls(pin=context.pin)

    @staticmethod
    def note_payload(nbytes: int) -> None:
        """Tell this process's pool a sender's payload size (every send within a host, inline ones
        included: the pool sizes itself by them)."""
        _POOL.note_payload(nbytes)

    @staticmethod
    def remove_left_by(rank: int, pid: int) -> list[str]:
        """Remove what sender ``rank`` (process ``pid``, dead) left half-published; the paths removed."""
        return remove_segments_of(rank, pid)

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> str:
        """Write ``payload`` into a segment; returns the receipt the receiver needs."""
        pool = self._pool if self.pooling else None
        pooled = pool.take(payload.nbytes) if pool is not None else None
        if pooled is not None:
            assert pool is not None
            try:
                pool.fit(pooled, payload.nbytes, rank)
                pooled.receiver = self._receiver
                pooled.write(payload)
            except BaseException:
                pool.discard(pooled)
                raise
            notice = _NOTICES.name()
            return f"p:{os.getpid()}:{pooled.ident}:{pooled.fd}:{pooled.inode}:{payload.nbytes}:{notice}"
        path = segment_path(token, rank, os.getpid())
        _hook("interrupt")
        with interrupts.uninterruptible():  # an interrupt then sees the segment and removes it
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _reserve(fd, payload.nbytes, rank)
            if payload.on_device:  # copied from the GPU into a map of it: no staging copy
                with mmap.mmap(fd, payload.nbytes, flags=mmap.MAP_SHARED) as mapped:
                    payload.write_into(mapped)
            else:
                payload.write_to_fd(fd)
        except BaseException:
            unlink(path)
            raise
        finally:
            os.close(fd)
        return f"n:{os.getpid()}:{payload.nbytes}"

    def fetch(self, token: str, rank: int, receipt: str) -> mmap.mmap | _View:
        """The payload ``rank`` published: a named segment mapped privately (and unlinked at once), a
        pooled one lent from a shared map of it.

        A pooled segment returns to its sender's pool once the returned buffer (and so every
        tensor viewing it) is gone; the map itself may be kept for the segment's next payload
        (:class:`KeptMaps`). Anything that is not a regular file of this user, readable by
        nobody else, is refused: another local user can at worst make a gather fail.
        """
        kind, pid, ident, fd_text, inode, nbytes, notice = _parse_receipt(receipt, rank)
        if kind == "p":
            kept = _KEPT.take(pid, ident, inode, nbytes)
            if kept is None:
                kept = _map_pooled(f"/proc/{pid}/fd/{fd_text}", rank, inode, nbytes)
            if self._pin:
                kept.pin()
            buf: mmap.mmap | _View = kept.lend(nbytes, (pid, ident), notice)
        else:
            buf = _map_named(segment_path(token, rank, pid), rank, nbytes)
        total = stated_length(buf)
        if total != nbytes:
            raise PayloadError(f"the segment of rank {rank} holds a payload of {total} bytes, not {nbytes}")
        return buf

    def release(self, token: str, rank: int, receipt: str | None = None, *, taken: bool = True) -> None:
        """The sender: remove its named segment of ``token`` if the receiver never took it. When the
        receiver never said it was done (``taken=False``), its pooled segment is never written again
        (the receiver may still map it)."""
        if receipt is None or receipt.startswith("n:"):
            unlink(segment_path(token, rank, os.getpid()))
        elif not taken and receipt.startswith("p:"):
            (self._pool or _POOL).drop(receipt.split(":")[2])

    def discard(self, token: str, rank: int, receipt: str) -> None:
        """The receiver, after a failure: remove ``rank``'s named segment if it is still there."""
        kind, pid, *_ = _parse_receipt(receipt, rank)
        if kind == "n":
            unlink(segment_path(token, rank, pid))


def remove_segments_of(rank: int | None, pid: int) -> list[str]:
    """Remove the named segments a dead sender (``rank``, or any rank, of process ``pid``) left: only
    regular files of this user whose name says so. Returns the paths removed."""
    suffix = f"_{int(pid)}" if rank is None else f"_{int(rank)}_{int(pid)}"
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if name.startswith(SEGMENT_PREFIX) and name.endswith(suffix):
                path = os.path.join(SHM_DIR, name)
                with contextlib.suppress(OSError):
                    info = os.lstat(path)
                    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                        os.unlink(path)
                        removed.append(path)
    return removed


def _parse_receipt(receipt: str, rank: int) -> tuple[str, int, str, str, int, int, str]:
    """``(kind, pid, id, fd, inode, nbytes, notice)`` of a receipt, checked (it came from another process)."""
    parts = str(receipt).split(":")
    try:
        if parts[0] == "n" and len(parts) == 3:
            return "n", int(parts[1]), "", "", 0, int(parts[2]), ""
        if parts[0] == "p" and len(parts) == 7 and (parts[6] == "" or _NOTICE_NAME.fullmatch(parts[6])):
            return "p", int(parts[1]), parts[2], str(int(parts[3])), int(parts[4]), int(parts[5]), parts[6]
    except ValueError:
        pass
    raise PayloadError(f"rank {rank} sent a malformed shared-memory receipt {receipt!r}")


def _checked(fd: int, path: str, rank: int, nbytes: int) -> os.stat_result:
    """The status of an opened segment, checked (see :func:`_check_owned`) to hold ``nbytes``."""
    info = os.fstat(fd)
    _check_owned(info, path, rank)
    if info.st_size < nbytes:
        raise PayloadError(
            f"segment {path} of rank {rank} holds {info.st_size} bytes but its receipt says {nbytes}"
        )
    return info


def _map_named(path: str, rank: int, nbytes: int) -> mmap.mmap:
    """Map a named segment copy-on-write, and unlink it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise PayloadError(f"rank {rank} published no usable segment at {path}: {exc}") from None
    try:
        _checked(fd, path, rank, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        unlink(path)


def _map_pooled(path: str, rank: int, inode: int, nbytes: int) -> SegmentMap:
    """Map a pooled segment whole, shared and writable, through its sender's ``/proc/<pid>/fd``: the
    receiver's tensors may be written into, and nothing reads the segment until they are gone (the
    sender only overwrites it, from its start, once they are)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        raise PeerLostError(
            f"rank {rank} exited or gave up before its payload was read: its pooled segment ({path}) is gone",
            [rank],
        ) from None
    try:
        info = _checked(fd, path, rank, nbytes)
        if info.st_ino != inode:
            raise PayloadError(f"{path} of rank {rank} is not the segment it published")
        mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return SegmentMap(mapping, inode, info.st_size, path)


def _check_owned(info: os.stat_result, path: str, rank: int) -> None:
    """Refuse a segment that is not a regular file of this user, private to it."""
    if not stat.S_ISREG(info.st_mode):
        raise PayloadError(f"{path} (claimed by rank {rank}) is not a regular file")
    if info.st_uid != os.geteuid():
        raise PayloadError(
            f"{path} (claimed by rank {rank}) belongs to uid {info.st_uid}, not to this job's user "
            f"(uid {os.geteuid()}); refusing data another user could have planted"
        )
    if info.st_mode & 0o077:
        raise PayloadError(
            f"{path} (claimed by rank {rank}) has mode {stat.S_IMODE(info.st_mode):o}, not 600"
        )


def _reserve(fd: int, nbytes: int, rank: int) -> None:
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
class _Segment:
    """A pooled segment: an unnamed file in ``/dev/shm`` whose pages stay allocated."""

    ident: str
    fd: int
    inode: int
    size: int = 0
    busy: bool = True
    drop_when_freed: bool = False
    receiver: ProcessInfo | None = None  # who maps it while busy (a dead one never frees it)
    looked: float = 0.0  # when it was last taken, or its receiver last found alive (time.monotonic)
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
    """Each sender's warm segments, reused once the receiver's views of them are gone.

    Allocating fresh tmpfs pages costs more than copying into them (64 MiB here: 22 ms into a fresh
    segment, 10 ms into a warm one through the sender's map; ``scripts/bench_gather.py
    --write-costs``). A large payload therefore goes into one of at most
    :attr:`LIMIT` pooled segments: ``O_TMPFILE`` files in ``/dev/shm`` that never have a name,
    so nothing is ever visible there and the kernel frees them when the process exits, however
    it exits. The receiver opens one through ``/proc/<sender pid>/fd/<fd>`` (checking its
    inode), maps it (shared), and the segment stays *busy* until the receiver reports that
    its views are gone (a weak reference's callback sends the report to the sender's notice socket,
    :class:`_Notices`; when it cannot, :class:`FreedReports` keeps the report for the round,
    which carries it to the sender in the verdict of the next gather they share, relayed by the first
    rank when a host's leader let the segment go); only then is it written again. A
    segment is pooled only while ``/dev/shm`` keeps at least four times its size free, and never
    resized once sent: its receiver may keep its map (:class:`KeptMaps`).
    """

    LIMIT = 2
    MIN_BYTES = 64 * 2**10
    RECENT = 8  # a free segment larger than twice the largest of the last 8 payloads is released
    LOOK_EVERY_S = 1.0  # a busy segment's receiver is looked up at most this often (a /proc read)

    def __init__(self) -> None:
        _POOLS.add(self)  # a forked child closes its copies of every pool's segments
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._recent: collections.deque[int] = collections.deque(maxlen=self.RECENT)

    def note_payload(self, nbytes: int) -> None:
        """A sender's payload size, pooled or not: segments much larger than what recent rounds
        sent are given back (a 1 GiB gather followed by small ones does not pin 1 GiB), and so are
        busy ones whose receiver died (it never reports them freed; looked up once a second)."""
        self._recent.append(nbytes)  # (a bounded deque: one step, safe between threads)
        if not self._segments:
            return
        self.heed(_NOTICES.take())
        with self._lock:
            bound = 2 * max(self._recent)
            now = time.monotonic()
            dropped = [
                s
                for s in self._segments.values()
                if (s.size > bound if not s.busy else self._receiver_gone(s, now))
            ]
            for seg in dropped:
                del self._segments[seg.ident]
        for seg in dropped:
            seg.close()

    def _receiver_gone(self, seg: _Segment, now: float) -> bool:
        if seg.receiver is None or now - seg.looked < self.LOOK_EVERY_S:
            return False
        seg.looked = now
        return not process_alive(seg.receiver)

    def release(self) -> int:
        """Give back every free segment; busy ones go when their receiver frees them.

        Returns:
            The bytes given back now.
        """
        self.heed(_NOTICES.take())
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

    def take(self, nbytes: int) -> _Segment | None:
        """A free pooled segment (marked busy), a new one, or None to use a fresh named one."""
        if nbytes < self.MIN_BYTES or not hasattr(os, "O_TMPFILE"):
            return None
        _hook("fork")
        if self._segments and not self._fits(nbytes):  # a notice since the last send may free one
            self.heed(_NOTICES.take())
        with self._lock:
            free = [seg for seg in self._segments.values() if not seg.busy]
            fitting = [seg for seg in free if seg.size >= nbytes]
            if fitting:  # the best fit: the smallest that holds it, its pages already touched
                seg = min(fitting, key=lambda s: s.size)
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
                seg = _Segment(secrets.token_hex(8), fd, os.fstat(fd).st_ino)
                self._segments[seg.ident] = seg
            seg.busy, seg.looked = True, time.monotonic()
            return seg

    def _fits(self, nbytes: int) -> bool:
        with self._lock:
            return any(not seg.busy and seg.size >= nbytes for seg in self._segments.values())

    def fit(self, seg: _Segment, nbytes: int, rank: int) -> None:
        """Make ``seg`` hold at least ``nbytes``, its pages reserved: a new segment is sized here, once
        (it never shrinks: a smaller payload would give back pages that the next large one must fault
        in again; nor grows: see :meth:`take`)."""
        if seg.size < nbytes:
            _reserve(seg.fd, nbytes, rank)
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

    def heed(self, notices: Collection[tuple[int, str]]) -> None:
        """Free the segments of these notices ``(receiver pid, segment id)``: each from the process the
        segment was lent to (any process of this user when that was not said)."""
        if not notices:
            return
        with self._lock:
            idents = set()
            for pid, ident in notices:
                seg = self._segments.get(ident)
                if seg is not None and (seg.receiver is None or seg.receiver.pid == pid):
                    idents.add(ident)
        self.freed(idents)

    def drop(self, ident: str) -> None:
        """Forget segment ``ident`` (its receiver may still map it; the kernel frees it later)."""
        with self._lock:
            seg = self._segments.pop(ident, None)
        if seg is not None:
            seg.close()

    def discard(self, seg: _Segment) -> None:
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


_NOTICE_NAME = re.compile(r"[0-9a-f]{16}")


def _notice_address(name: str) -> bytes:
    """The abstract address of notice socket ``name`` (this package's: a second copy in one process,
    as the benchmark's ``--against`` loads it, has sockets of its own)."""
    return f"\0{__package__}/freed/{name}".encode()


class _Notices:
    """This process's socket for "freed" notices, as a sender of pooled segments.

    A receiver's report that its views of a segment are gone otherwise reaches the sender in the
    verdict of their next gather: a round late, so meanwhile the sender writes its other segment, and
    keeps two. So a receiver sends the report straight here when it can (an abstract Unix datagram
    address, named in the receipt), and keeps it for a verdict only when it cannot: each report goes
    one way, never twice. The sender reads its notices, never waiting, at every send
    (:meth:`SegmentPool.note_payload`), when no free segment fits a payload, and when it releases its
    pool; it heeds one only from the process the segment was lent to (the kernel names a datagram's
    sender).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._name = ""
        self._tried = False

    def name(self) -> str:
        """The name of this process's notice socket, for its receipts ("" when it cannot listen)."""
        if not self._tried:
            _hook("fork")
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
            sock.bind(_notice_address(name))
        except OSError as exc:
            sock.close()
            logger.debug("pooled segments are reported freed in verdicts only: %s", exc)
            return
        self._sock, self._name = sock, name

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

    def forked(self) -> None:
        """A forked child must not read its parent's notices: it closes its copy (no shutdown)."""
        if self._sock is not None:
            self._sock.close()
        self._lock, self._sock, self._name, self._tried = threading.Lock(), None, "", False


_POOLS: weakref.WeakSet[SegmentPool] = weakref.WeakSet()  # every pool of this process (one but in tests)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_TRUNCATED = int(socket.MSG_TRUNC)
_NO_WAIT = int(socket.MSG_DONTWAIT)
_NOTICES = _Notices()
_TELLER: socket.socket | None = None  # this process's socket for sending notices (unbound)


def _tell_freed(notice: str, ident: str) -> bool:
    """Send the notice that this process's views of segment ``ident`` are gone to the sender's socket
    ``notice``; False when there is none or it cannot take it now (the report then goes in a verdict)."""
    global _TELLER
    if not notice:
        return False
    try:
        if _TELLER is None:
            _TELLER = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        _TELLER.sendto(ident.encode(), _NO_WAIT, _notice_address(notice))
    except OSError:
        return False
    return True


_POOL = SegmentPool()
_View = ctypes.Array[ctypes.c_ubyte]  # what a pooled payload is fetched as: a view of a kept map


@dataclass(eq=False)
class SegmentMap:
    """A receiver's shared map of a whole pooled segment (a sent segment never changes size).

    Made by this module's fetch; public so that :class:`KeptMaps` can be driven on its own (tests)."""

    mapping: mmap.mmap
    inode: int
    size: int
    source: str = ""  # /proc/<sender pid>/fd/<fd>: the segment while its sender holds it
    pinned: Registration | None = None  # registered with CUDA (see pin); unregistered when it goes
    pin_tried: bool = False

    def pin(self) -> None:
        """Register the whole map with the CUDA runtime, once (copies from it to a GPU then run at pinned
        speed); it is unregistered when this map goes."""
        if not self.pin_tried:
            self.pin_tried = True
            self.pinned = Registration.of(self.mapping, self.size)
            if self.pinned is not None:
                weakref.finalize(self, self.pinned.close)

    def lend(self, nbytes: int, report: tuple[int, str], notice: str) -> _View:
        """The first ``nbytes`` as a buffer of their own. Once it (and every tensor viewing it) is gone,
        ``report`` goes to the sender's notice socket ``notice`` (or, when it cannot, to the freed ones
        for a verdict), and this map may be kept for the segment's next payload."""
        view = (ctypes.c_ubyte * nbytes).from_buffer(self.mapping)
        epoch = _KEPT.epoch

        def gone(ref: weakref.ref[_View]) -> None:
            _LENT.pop(id(ref), None)
            if not _tell_freed(notice, report[1]):
                REPORTS.add(report)
            _KEPT.keep(report, self, epoch)

        ref = weakref.ref(view, gone)
        _LENT[id(ref)] = ref
        return view


class KeptMaps:
    """The first rank's maps of its senders' pooled segments, kept between rounds (one per process, used by
    this module's fetch; public, with its bounds, so that tests and tuning can read and drive it).

    Mapping a pooled segment (open through ``/proc``, check, map, later unmap) costs about 50 µs
    per payload cold, a sixth of the first rank's call at 1 MiB. A map whose views are gone is kept
    here, and the segment's next payload is lent from it: a shared map shows what the sender wrote
    since.
    Only segments of at most :attr:`MAX_BYTES`, at most :attr:`PER_SENDER` per sender process and
    :attr:`MAX_TOTAL_BYTES` in all, least recently used given up first: a kept map holds its
    segment's pages (and a descriptor: ``mmap`` dups it) even after the sender has let the segment
    go; a map registered with CUDA (:meth:`SegmentMap.pin`) is kept whatever its size and counts in neither
    bound, since registering again costs as much as a copy (its pages are its sender's pooled segment's,
    unless the sender let that go: see below). A sender holds at most :attr:`SegmentPool.LIMIT`
    segments at once, so a map beyond that is
    one it let go; and when a sender's new segment comes, its other kept maps whose segment it no
    longer holds are given up at once. :func:`release_shared_memory` forgets them all.
    """

    MAX_BYTES = 4 * 2**20
    MAX_TOTAL_BYTES = 64 * 2**20
    PER_SENDER = SegmentPool.LIMIT

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[tuple[int, str], SegmentMap] = collections.OrderedDict()
        self._senders: dict[int, list[str]] = {}  # each sender's kept segment ids, least recent first
        self._bytes = 0
        self.epoch = 0  # maps lent before the last release are not kept

    def _pop(self, key: tuple[int, str]) -> SegmentMap | None:
        """Forget the kept map ``key`` (with the lock held); returns it."""
        kept = self._maps.pop(key, None)
        if kept is not None:
            self._bytes -= _counted(kept)
            idents = self._senders[key[0]]
            idents.remove(key[1])
            if not idents:
                del self._senders[key[0]]
        return kept

    def take(self, pid: int, ident: str, inode: int, nbytes: int) -> SegmentMap | None:
        """The kept map of segment ``ident`` of process ``pid``, if it holds ``nbytes``. None for a
        segment new to it: its sender's other kept maps are then looked up and dropped if it let
        their segment go (it may have, to make this one). Registered ones are looked up every time (a
        sender gives back a large segment once its payloads shrink; the map would pin its pages)."""
        with self._lock:
            kept = self._pop((pid, ident))
            others = [
                (i, self._maps[(pid, i)])
                for i in self._senders.get(pid, ())
                if kept is None or self._maps[(pid, i)].pinned is not None
            ]
        if others:
            self._drop_let_go(pid, others)
        if kept is None or kept.inode != inode or kept.size < nbytes:
            return None
        return kept

    def _drop_let_go(self, pid: int, maps: list[tuple[str, SegmentMap]]) -> None:
        gone = []
        for ident, kept in maps:
            try:
                held = not kept.source or os.stat(kept.source).st_ino == kept.inode
            except OSError:  # the sender closed it, or exited
                held = False
            if not held:
                gone.append((ident, kept))
        if gone:
            with self._lock:
                for ident, kept in gone:
                    if self._maps.get((pid, ident)) is kept:
                        self._pop((pid, ident))  # unmapped once unreferenced

    def keep(self, key: tuple[int, str], kept: SegmentMap, epoch: int) -> None:
        """Keep ``kept`` for the next payload of segment ``key`` (called as its last view goes, from
        any thread: never waits for the lock, and gives the map up when it is taken)."""
        if (
            epoch != self.epoch
            or (kept.size > self.MAX_BYTES and kept.pinned is None)
            or not self._lock.acquire(blocking=False)
        ):
            return
        try:
            self._pop(key)
            idents = self._senders.get(key[0], [])
            for ident in idents[: len(idents) - self.PER_SENDER + 1]:  # the least recent beyond the bound
                self._pop((key[0], ident))
            self._senders.setdefault(key[0], []).append(key[1])
            self._maps[key] = kept
            self._bytes += _counted(kept)
            # The least recent counted map goes (unmapped once unreferenced).
            while self._bytes > self.MAX_TOTAL_BYTES:
                self._pop(next(k for k, m in self._maps.items() if m.pinned is None))
        finally:
            self._lock.release()

    def forget(self) -> None:
        """Unmap every kept map, and keep none of those lent now."""
        with self._lock:
            self.epoch += 1
            self._maps.clear()
            self._senders.clear()
            self._bytes = 0

    def held(self) -> tuple[int, int]:
        """``(maps, bytes)`` kept."""
        with self._lock:
            return len(self._maps), self._bytes


def _counted(kept: SegmentMap) -> int:
    """What a kept map counts towards :attr:`KeptMaps.MAX_TOTAL_BYTES`: nothing when registered."""
    return 0 if kept.pinned is not None else kept.size


_KEPT = KeptMaps()
# This process's views of pooled segments, until they are gone (by id: a view is unhashable).
_LENT: dict[int, weakref.ref[_View]] = {}


def release_shared_memory() -> int:
    """Give back the shared memory this process keeps warm for its next gathers.

    Free pooled segments are closed at once (the kernel frees their pages); segments a
    receiver still maps go as soon as it reports them freed. The maps of other ranks' segments
    this process keeps as a first rank are unmapped (:class:`KeptMaps`). Called when the
    default process group is destroyed or replaced; call it yourself, on every rank, after a
    large gather when the job goes on without more. Returns the bytes given back now.
    """
    _KEPT.forget()
    return _POOL.release()


def kept_maps() -> tuple[int, int]:
    """``(maps, bytes)`` of other ranks' pooled segments this process keeps mapped as a first rank,
    between rounds (:class:`KeptMaps`)."""
    return _KEPT.held()


def pooled_bytes() -> tuple[int, int]:
    """``(segments, bytes)`` of ``/dev/shm`` this process's segment pool holds."""
    return _POOL.held()


class FreedReports:
    """This process's reports, as a receiver, that its views of other processes' pooled segments are
    gone, for the senders its notice could not reach (see :class:`_Notices`): the round carries them
    in its claims and verdicts, each once. Reports name processes, not ranks (a rank number may belong
    to another process by the time a report travels: the default group was made anew); as they travel
    they are ``[rank, segment id, pid]`` ("notes"). One per process: :data:`REPORTS`.
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
            _POOL.freed({n[1] for n in notes if type(n) is list and len(n) == 3 and n[0] == rank})


REPORTS = FreedReports()
SharedMemoryTransport.reports = REPORTS


_HOOKED: set[str] = set()  # the process hooks registered so far (nothing is registered at import)


def _hook(what: str) -> None:
    """Registers a process hook once, before this process first has what it resets (registered twice by a
    race, it runs twice, harmlessly): ``"fork"``, a forked child closes its copies of the pool's segments
    and of the notice socket; ``"interrupt"``, an interrupted process removes the named segments it
    published that nobody took (pooled ones have no name: the kernel frees them at exit)."""
    if what in _HOOKED:
        return
    _HOOKED.add(what)
    if what == "fork":
        os.register_at_fork(after_in_child=_forked)
    else:
        interrupts.on_interrupt(lambda: remove_segments_of(None, os.getpid()))


def _forked() -> None:
    _NOTICES.forked()
    for pool in list(_POOLS):
        pool.forked()
