"""Internal. Shared-memory transport: one POSIX segment per sender and round, mapped zero-copy.

Segment ``/dev/shm/du_<token>_<rank>_<pid>``: ``token`` is unguessable and fresh per round
(so two jobs, or a crashed run's leftovers, never collide), ``pid`` is the sender's, so
``distribute-utils clean`` can tell a dead owner's segment. Mode 0600.

- ``publish`` creates the segment exclusively, reserves its exact size with
  ``posix_fallocate`` (a full ``/dev/shm`` gives :class:`SpaceError` naming the size needed
  and the space free, never a SIGBUS later), then ``pwrite``s the payload into it. Large
  payloads reuse warm pooled segments (see :class:`.segment_pool.SegmentPool`), copied into the
  sender's own map of them. Tensors on a GPU are copied from there straight into the
  segment, once: a pooled segment is registered with the CUDA runtime (:mod:`.pinning`) the first
  time a GPU payload goes into it, and stays registered while pooled, so the copy runs at pinned speed.
- ``fetch`` maps the segment copy-on-write, unlinks its name at once and returns the map:
  decoded tensors are views of it, valid for as long as they live. A pooled segment is mapped
  shared instead (nobody else reads it until its receiver lets it go), and its map is kept for its
  next payload (see :class:`.kept_maps.KeptMaps`: a big one only while its sender holds the segment).
  A first rank that copies what it receives to a GPU (``pin=True``) registers its map of a pooled
  segment once and keeps it, on the same terms.
- ``release`` unlinks the sender's segment if the first rank never took it.

No ``multiprocessing.shared_memory``: nothing is registered with the resource tracker.

This module is the carrier and its named segments; the sender's pool and the receivers' reports are
:mod:`.segment_pool`, the first rank's maps of pooled segments :mod:`.kept_maps` (their public names
are importable from here too). The pool and the kept maps belong to the default process group
(:func:`distribute_utils.owners.owned`, the process's when there is none): a new group starts with
neither.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

from .. import interrupts
from ..caches import Recent
from ..errors import PayloadError
from ..owners import owned, process_owned
from ..processes import SHM_DIR, ProcessInfo
from ..wire import EncodedPayload, stated_length
from .base import Context, Destination, removed_on_interrupt
from .files import unlink
from .kept_maps import KeptMaps, SegmentMap, checked, map_pooled
from .named_files import PREFIX, HostFile, named_files, remove_named
from .segment_pool import (
    NOTICE_NAME,
    BigSegmentWatch,
    FreedReports,
    Notices,
    Pools,
    SegmentPool,
    reserve,
    shm_space,
)

__all__ = [
    "REPORTS",
    "SEGMENT_PREFIX",
    "BigSegmentWatch",
    "FreedReports",
    "KeptMaps",
    "SegmentMap",
    "SegmentPool",
    "SharedMemoryTransport",
    "kept_maps",
    "map_named",
    "pooled_bytes",
    "release_shared_memory",
    "remove_segments_of",
    "segment_path",
    "shm_space",
]

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = PREFIX


def segment_path(token: str, rank: int, pid: int) -> str:
    """Path of the segment ``rank`` (process ``pid``) publishes in round ``token``."""
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{token}_{rank}_{pid}")


class SharedMemoryTransport:
    """The segment carrier: moves payloads through ``/dev/shm`` between ranks of one host; implements
    :class:`.base.Carrier` (kind ``"shm"``).

    Receipts (what ``publish`` returns, carried to the receiver in the sender's claim) say
    where the payload is: ``n:<pid>:<nbytes>`` for a named segment, or
    ``p:<pid>:<id>:<fd>:<inode>:<nbytes>:<notice>`` for a pooled one (``notice``: where the
    receiver tells the sender at once that its views are gone, see :class:`.segment_pool.Notices`; may be empty).
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
    scope = "host"
    medium = "memory"
    max_bytes: int | None = None
    label = "/dev/shm"
    devices = "to_cpu"  # (a GPU payload is copied from there into the segment, registered)
    needs_go = False
    checksums = False
    settings: tuple[str, ...] = ()
    pooling = True
    """False: every segment is a named one, whatever ``pool`` says (a documented seam for tests of
    named segments: a dead sender's pooled segment dies with it)."""
    reports: FreedReports  # (set below: this process's, one for every instance)

    def __init__(
        self, pool: bool | SegmentPool = False, receiver: ProcessInfo | None = None, pin: bool = False
    ) -> None:
        self._pool = owned(SegmentPool) if pool is True else pool or None
        self._receiver = receiver
        self._pin = pin

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> SharedMemoryTransport:
        return cls(pin=context.pin)

    @classmethod
    def sending(cls, destination: Destination) -> SharedMemoryTransport:
        """Pooled segments when the receiver can open this process's descriptors."""
        return cls(pool=destination.pool, receiver=destination.receiver)

    @staticmethod
    def remove_left_by(rank: int | None, pid: int) -> list[str]:
        """Remove what sender ``rank`` (or any rank) of process ``pid`` (dead) left half-published: its
        named segments (pooled ones die with it); the paths removed."""
        return remove_segments_of(rank, pid)

    files_label = "segment(s)"

    @staticmethod
    def files_on_host(shm_dir: str = SHM_DIR) -> list[HostFile]:
        """Every ``du_*`` file in ``shm_dir`` (named segments; others' files of that name too, their
        ``pid`` None), with its owner's liveness."""
        return named_files(shm_dir)

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
            notice = process_owned(Notices).name()
            return f"p:{os.getpid()}:{pooled.ident}:{pooled.fd}:{pooled.inode}:{payload.nbytes}:{notice}"
        path = segment_path(token, rank, os.getpid())
        removed_on_interrupt(SharedMemoryTransport)
        with interrupts.uninterruptible():  # an interrupt then sees the segment and removes it
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            reserve(fd, payload.nbytes, rank)
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

    @staticmethod
    def names_token(receipt: str) -> bool:
        """A named segment's name is made from the token (others can see it); a pooled one has no name."""
        return not receipt.startswith("p:")

    def fetch(self, token: str, rank: int, receipt: str) -> Any:
        """The payload ``rank`` published: a named segment mapped privately (and unlinked at once), a
        pooled one lent from a shared map of it.

        A pooled segment returns to its sender's pool once the returned buffer (and so every
        tensor viewing it) is gone; the map itself may be kept for the segment's next payload
        (:class:`.kept_maps.KeptMaps`). Anything that is not a regular file of this user, readable by
        nobody else, is refused: another local user can at worst make a gather fail.
        """
        kind, pid, ident, fd_text, inode, nbytes, notice = _parse_receipt(receipt, rank)
        if kind == "p":
            keeper = owned(KeptMaps)
            kept = keeper.take(pid, ident, inode, nbytes)
            if kept is None:
                kept = map_pooled(f"/proc/{pid}/fd/{fd_text}", rank, inode, nbytes)
            if self._pin:
                kept.pin()
            keeper.lending(kept)
            buf: Any = kept.lend(nbytes, (pid, ident), notice, keeper)
        else:
            buf = map_named(segment_path(token, rank, pid), rank, nbytes)
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
            (self._pool or owned(SegmentPool)).drop(receipt.split(":")[2])

    def discard(self, token: str, rank: int, receipt: str) -> None:
        """The receiver, after a failure: remove ``rank``'s named segment if it is still there."""
        kind, pid, *_ = _parse_receipt(receipt, rank)
        if kind == "n":
            unlink(segment_path(token, rank, pid))


def remove_segments_of(rank: int | None, pid: int) -> list[str]:
    """Remove the named segments a dead sender (``rank``, or any rank, of process ``pid``) left: only
    regular files of this user whose name says so. Returns the paths removed."""
    return remove_named(SHM_DIR, rank, pid)


_Parsed = tuple[str, int, str, str, int, int, str]
_PARSED: Recent[str, _Parsed] = Recent(256)  # receipts parsed, as they were: a repeat's come again and again
_PARSED_MAX_CHARS = 128  # (a receipt is about 70 characters; a longer text is parsed, not kept)


def _parse_receipt(receipt: str, rank: int) -> _Parsed:
    """``(kind, pid, id, fd, inode, nbytes, notice)`` of a receipt, checked (it came from another process;
    a function of its text, kept for the text)."""
    if type(receipt) is not str or len(receipt) > _PARSED_MAX_CHARS:
        return _parsed(receipt, rank)
    found = _PARSED.get(receipt)
    return found if found is not None else _PARSED.put(receipt, _parsed(receipt, rank))


def _parsed(receipt: str, rank: int) -> _Parsed:
    parts = str(receipt).split(":")
    try:
        if parts[0] == "n" and len(parts) == 3:
            return "n", int(parts[1]), "", "", 0, int(parts[2]), ""
        if parts[0] == "p" and len(parts) == 7 and (parts[6] == "" or NOTICE_NAME.fullmatch(parts[6])):
            return "p", int(parts[1]), parts[2], str(int(parts[3])), int(parts[4]), int(parts[5]), parts[6]
    except ValueError:
        pass
    raise PayloadError(f"rank {rank} sent a malformed shared-memory receipt {receipt!r}")


def map_named(path: str, rank: int, nbytes: int) -> mmap.mmap:
    """Map a named segment (or any file a carrier names so) copy-on-write, checked to be this user's
    and private, and unlink it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise PayloadError(f"rank {rank} published no usable segment at {path}: {exc}") from None
    try:
        checked(fd, path, rank, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        unlink(path)


def release_shared_memory() -> int:
    """Give back the shared memory this process keeps warm for its next gathers.

    Free pooled segments are closed at once (the kernel frees their pages); segments a
    receiver still maps go as soon as it reports them freed. The maps of other ranks' segments
    this process keeps as a first rank are unmapped (:class:`.kept_maps.KeptMaps`). Done for the
    default process group's pool and maps when the group is destroyed or replaced (the next group
    has its own); call it yourself, on every rank, after a large gather when the job goes on without
    more. Returns the bytes given back now.
    """
    owned(KeptMaps).forget()
    return owned(SegmentPool).release()


def kept_maps() -> tuple[int, int]:
    """``(maps, bytes)`` of other ranks' pooled segments this process keeps mapped as a first rank,
    between rounds (:class:`.kept_maps.KeptMaps`), in the current default group."""
    return owned(KeptMaps).held()


def pooled_bytes() -> tuple[int, int]:
    """``(segments, bytes)`` of ``/dev/shm`` this process's segment pools hold: the current default
    group's, and the segments of earlier groups' pools that a receiver still maps (retiring)."""
    pool = owned(SegmentPool)
    held = [pool.held(), *(p.held() for p in list(process_owned(Pools).retiring) if p is not pool)]
    return sum(n for n, _ in held), sum(b for _, b in held)


REPORTS: FreedReports = process_owned(FreedReports)
"""This process's freed reports (process-wide: they outlive the group they were made in)."""
SharedMemoryTransport.reports = REPORTS
