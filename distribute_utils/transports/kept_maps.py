"""Internal. The first rank's maps of its senders' pooled segments: mapped, lent as views, kept between rounds.

A receiver maps a sender's pooled segment (:func:`map_pooled`, through ``/proc/<pid>/fd``), lends
the payload as a buffer of its own (:meth:`SegmentMap.lend`), and, once every view is gone, tells
the sender (:mod:`.segment_pool`) and keeps the map for the segment's next payload
(:class:`KeptMaps`, one per default process group: :func:`distribute_utils.owners.owned`, forgotten
when the group goes). The views themselves are the user's and may outlive the group: their
callbacks are held process-wide (:class:`LentViews`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import stat
import threading
import weakref
from dataclasses import dataclass

from ..errors import PayloadError, PeerLostError
from ..owners import after_fork, process_owned
from .pinning import Registration
from .segment_pool import BigSegmentWatch, FreedReports, Notices, SegmentPool

__all__ = ["KeptMaps", "LentViews", "SegmentMap", "check_owned", "checked", "map_pooled"]


def checked(fd: int, path: str, rank: int, nbytes: int) -> os.stat_result:
    """The status of an opened segment, checked (see :func:`check_owned`) to hold ``nbytes``."""
    info = os.fstat(fd)
    check_owned(info, path, rank)
    if info.st_size < nbytes:
        raise PayloadError(
            f"segment {path} of rank {rank} holds {info.st_size} bytes but its receipt says {nbytes}"
        )
    return info


def map_pooled(path: str, rank: int, inode: int, nbytes: int) -> SegmentMap:
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
        info = checked(fd, path, rank, nbytes)
        if info.st_ino != inode:
            raise PayloadError(f"{path} of rank {rank} is not the segment it published")
        mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # The payload's pages mapped in one call, as it arrives (the first rank takes each claim as it comes,
    # while other senders still copy): not one fault per 64 KiB as its reader walks it. Only the payload's
    # pages: the rest of the segment (a larger payload's) is not read.
    with contextlib.suppress(OSError):  # (a kernel before 5.14: the reader faults them in)
        mapping.madvise(_POPULATE_READ, 0, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    return SegmentMap(mapping, inode, info.st_size, path)


_POPULATE_READ = 22  # MADV_POPULATE_READ (Linux 5.14): fault the range's page tables in, reading


def check_owned(info: os.stat_result, path: str, rank: int) -> None:
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


_View = ctypes.Array[ctypes.c_ubyte]  # what a pooled payload is fetched as: a view of a kept map


class LentViews(dict[int, "weakref.ref[_View]"]):
    """This process's views of pooled segments, until they are gone (by id: a view is unhashable);
    process-wide (``process_owned(LentViews)``): the views are the user's, and may outlive the group."""


@dataclass(eq=False)
class SegmentMap:
    """A receiver's shared map of a whole pooled segment (a sent segment never changes size).

    Made by :func:`map_pooled`; public so that :class:`KeptMaps` can be driven on its own (tests)."""

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

    def lend(self, nbytes: int, report: tuple[int, str], notice: str, keeper: KeptMaps) -> _View:
        """The first ``nbytes`` as a buffer of their own. Once it (and every tensor viewing it) is gone,
        ``report`` goes to the sender's notice socket ``notice`` (or, when it cannot, to the freed ones
        for a verdict), and this map may be kept for the segment's next payload by ``keeper`` (unless
        it forgot its maps meanwhile)."""
        view = (ctypes.c_ubyte * nbytes).from_buffer(self.mapping)
        epoch = keeper.epoch
        lent = process_owned(LentViews)

        def gone(ref: weakref.ref[_View]) -> None:
            lent.pop(id(ref), None)
            if not process_owned(Notices).tell(notice, report[0], report[1]):
                process_owned(FreedReports).add(report)
            keeper.keep(report, self, epoch)

        ref = weakref.ref(view, gone)
        lent[id(ref)] = ref
        return view


class KeptMaps:
    """The first rank's maps of its senders' pooled segments, kept between rounds (the carrier's:
    ``owned(KeptMaps)``, one per default process group, forgotten when it goes; public, with its
    bounds, so that tests and tuning can read and drive it).

    Mapping a pooled segment (open through ``/proc``, check, map, later unmap) costs about 50 µs
    per payload cold, a sixth of the first rank's call at 1 MiB; for a big one, filling its page tables
    costs more than a fifth of the first rank's CPU at 64 MiB. A map whose views are gone is kept here,
    and the segment's next payload is lent from it: a shared map shows what the sender wrote since, and
    its page tables stay filled. A sender holds at most :attr:`SegmentPool.LIMIT` segments at once, so
    at most :attr:`PER_SENDER` maps are kept per sender process, least recently used given up first;
    and when a sender's new segment comes, its other kept maps whose segment it no longer holds are
    given up at once.

    A kept map holds its segment's pages (and a descriptor: ``mmap`` dups it) even after the sender has
    let the segment go. So a map of at most :attr:`MAX_BYTES` counts towards :attr:`MAX_TOTAL_BYTES`
    in all; a larger map, or one registered with CUDA (:meth:`SegmentMap.pin`, where registering again
    costs as much as a copy), counts in neither bound but is *watched*: kept only while its sender holds
    its segment, looked up at each of that sender's payloads and every ``SegmentPool.KEEP_S / 2``
    seconds by :class:`.segment_pool.BigSegmentWatch` (:meth:`drop_idle`). So its pages outlive the
    sender's segment by at most that long. :func:`.shm.release_shared_memory` forgets them all.
    """

    MAX_BYTES = 4 * 2**20
    MAX_TOTAL_BYTES = 64 * 2**20
    PER_SENDER = SegmentPool.LIMIT

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[tuple[int, str], SegmentMap] = collections.OrderedDict()
        self._lent: set[int] = set()  # ids of watched maps lent now (set.add / discard: atomic)
        _EVERY.add(self)
        self._senders: dict[int, list[str]] = {}  # each sender's kept segment ids, least recent first
        self._bytes = 0
        self.epoch = 0  # maps lent before the last release are not kept

    def _pop(self, key: tuple[int, str]) -> SegmentMap | None:
        """Forget the kept map ``key`` (with the lock held); returns it."""
        kept = self._maps.pop(key, None)
        if kept is not None:
            self._bytes -= self._counted(kept)
            idents = self._senders[key[0]]
            idents.remove(key[1])
            if not idents:
                del self._senders[key[0]]
        return kept

    def take(self, pid: int, ident: str, inode: int, nbytes: int) -> SegmentMap | None:
        """The kept map of segment ``ident`` of process ``pid``, if it holds ``nbytes``. None for a
        segment new to it: its sender's other kept maps are then looked up and dropped if it let
        their segment go (it may have, to make this one). Watched ones are looked up every time (a
        sender gives back a large segment once its payloads shrink; the map would hold its pages)."""
        with self._lock:
            kept = self._pop((pid, ident))
            others = [
                (i, self._maps[(pid, i)])
                for i in self._senders.get(pid, ())
                if kept is None or self._watched(self._maps[(pid, i)])
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
        self._lent.discard(id(kept))
        if epoch != self.epoch or not self._lock.acquire(blocking=False):
            return
        try:
            self._pop(key)
            idents = self._senders.get(key[0], [])
            for ident in idents[: len(idents) - self.PER_SENDER + 1]:  # the least recent beyond the bound
                self._pop((key[0], ident))
            self._senders.setdefault(key[0], []).append(key[1])
            self._maps[key] = kept
            self._bytes += self._counted(kept)
            # The least recent counted map goes (unmapped once unreferenced).
            while self._bytes > self.MAX_TOTAL_BYTES:
                self._pop(next(k for k, m in self._maps.items() if self._counted(m)))
        finally:
            self._lock.release()

    def lending(self, kept: SegmentMap) -> None:
        """The receiver lends ``kept`` now (before :meth:`SegmentMap.lend`; not from a weakref callback): a
        watched one is watched from now on, until it is given up (:class:`.segment_pool.BigSegmentWatch`)."""
        if self._watched(kept):
            self._lent.add(id(kept))
            process_owned(BigSegmentWatch).watch(self)

    def drop_idle(self) -> bool:
        """Give up the watched maps whose sender let their segment go; True while one is still kept or
        lent (:class:`.segment_pool.BigSegmentWatch` asks, from its thread)."""
        with self._lock:
            watched = [(key, m) for key, m in self._maps.items() if self._watched(m)]
        by_sender: dict[int, list[tuple[str, SegmentMap]]] = {}
        for (pid, ident), kept in watched:
            by_sender.setdefault(pid, []).append((ident, kept))
        for pid, maps in by_sender.items():
            self._drop_let_go(pid, maps)
        with self._lock:
            return bool(self._lent) or any(self._watched(m) for m in self._maps.values())

    def forked(self) -> None:
        """In a forked child: every map forgotten (the child's copies of them would hold the segments'
        pages with nothing to watch them); the views it inherited stay valid."""
        self._lock = threading.Lock()  # (the parent's may have been held at the fork)
        self._lent = set()
        self.forget()

    def _watched(self, kept: SegmentMap) -> bool:
        """Whether ``kept`` is kept only while its sender holds its segment (see the class doc)."""
        return kept.pinned is not None or kept.size > self.MAX_BYTES

    def _counted(self, kept: SegmentMap) -> int:
        """What ``kept`` counts towards :attr:`MAX_TOTAL_BYTES`: nothing when watched."""
        return 0 if self._watched(kept) else kept.size

    def forget(self) -> None:
        """Unmap every kept map, and keep none of those lent now."""
        with self._lock:
            self.epoch += 1
            self._maps.clear()
            self._senders.clear()
            self._bytes = 0

    def close(self) -> None:
        """The group is gone: forget every map (:meth:`forget`)."""
        self.forget()

    def held(self) -> tuple[int, int]:
        """``(maps, bytes)`` kept, watched ones included."""
        with self._lock:
            return len(self._maps), sum(m.size for m in self._maps.values())


_EVERY: weakref.WeakSet[KeptMaps] = weakref.WeakSet()  # every group's and the process's (see _forked)


def _forked() -> None:
    for keeper in list(_EVERY):
        keeper.forked()


after_fork(_forked)
