"""Shared-memory transport: one POSIX segment per sender and round, mapped zero-copy.

Segment ``/dev/shm/du_<token>_<rank>_<pid>``: ``token`` is unguessable and fresh per round
(so two jobs, or a crashed run's leftovers, never collide), ``pid`` is the sender's, so
``distribute-utils clean`` can tell a dead owner's segment. Mode 0600.

- ``publish`` creates the segment exclusively, reserves its exact size with
  ``posix_fallocate`` (a full ``/dev/shm`` gives :class:`SpaceError` naming the size needed
  and the space free, never a SIGBUS later), then ``pwrite``s the payload into it.
- ``fetch`` maps the segment copy-on-write, unlinks its name at once and returns the map:
  decoded tensors are views of it, valid for as long as they live.
- ``release`` unlinks the sender's segment if the first rank never took it.

No ``multiprocessing.shared_memory``: nothing is registered with the resource tracker.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading

from .._host import SHM_DIR
from ..errors import PayloadError, SpaceError
from ..wire import EncodedPayload, read_prefix

__all__ = ["SEGMENT_PREFIX", "SharedMemoryTransport", "segment_path"]

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
    """Moves payloads through ``/dev/shm`` between ranks of one host.

    Args:
        pids: process id of every rank of the round (from the group's peer exchange), used to
            name segments.
    """

    name = "shm"

    def __init__(self, pids: dict[int, int]) -> None:
        self._pids = pids

    def _path(self, token: str, rank: int) -> str:
        return segment_path(token, rank, self._pids[rank])

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> None:
        path = self._path(token, rank)
        fd = _SPARE.claim(path, payload.nbytes)  # pages reserved in the background, if any
        fresh = fd is None
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if fresh:
                _reserve(fd, payload.nbytes, rank)
            payload.write_to_fd(fd)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        _SPARE.prepare(payload.nbytes)

    def fetch(self, token: str, rank: int) -> mmap.mmap:
        path = self._path(token, rank)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PayloadError(f"rank {rank} published no segment at {path}") from None
        try:
            size = os.fstat(fd).st_size
            buf = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            _unlink(path)
        prefix = read_prefix(buf)
        if prefix.total_len != size:
            raise PayloadError(
                f"segment {path} of rank {rank} holds {size} bytes but its payload says {prefix.total_len}"
            )
        return buf

    def release(self, token: str, rank: int) -> None:
        _unlink(self._path(token, rank))


def _reserve(fd: int, nbytes: int, rank: int) -> None:
    """Allocate every page of a new segment now, so a full /dev/shm fails here, cleanly."""
    try:
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


class _SpareSegment:
    """One anonymous segment per process, reserved in the background for the next payload.

    Allocating fresh tmpfs pages costs more than copying into them (about 20 ms of the 30 ms
    it takes to publish 64 MiB here). After a large publish, a thread reserves an unnamed
    ``O_TMPFILE`` segment of the same size in ``/dev/shm``; the next publish that fits gives
    it the round's name (a hard link through ``/proc/self/fd``, which fails if the name
    exists, like ``O_EXCL``), truncates it to the exact size and only copies. Unnamed, it is
    invisible in ``/dev/shm`` and freed by the kernel when the process exits, however it
    exits. Kept only while ``/dev/shm`` has at least four times its size free.
    """

    MIN_BYTES = 4 * 2**20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: tuple[int, int] | None = None  # (fd, size)
        self._busy = False

    def claim(self, path: str, nbytes: int) -> int | None:
        """An open fd of the new segment ``path``, backed by the spare's pages, or None."""
        with self._lock:
            ready = self._ready
            if ready is None or not nbytes <= ready[1] <= 2 * nbytes:
                return None
            self._ready = None
        fd = ready[0]
        try:
            # linkat(..., AT_SYMLINK_FOLLOW): Python uses it once a dir fd is given.
            dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=dir_fd, follow_symlinks=True)
            finally:
                os.close(dir_fd)
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def prepare(self, nbytes: int) -> None:
        """Reserve a spare of ``nbytes`` in the background (no-op for small payloads)."""
        if nbytes < self.MIN_BYTES or not hasattr(os, "O_TMPFILE"):
            return
        with self._lock:
            if self._busy or self._ready is not None:
                return
            self._busy = True
        threading.Thread(
            target=self._make, args=(nbytes,), name="distribute-utils-spare", daemon=True
        ).start()

    def _make(self, nbytes: int) -> None:
        fd = -1
        try:
            if shm_space()[1] >= 4 * nbytes:
                fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
                os.posix_fallocate(fd, 0, nbytes)
                with self._lock:
                    self._ready, fd = (fd, nbytes), -1
        except OSError:
            logger.debug("no spare segment of %d bytes", nbytes, exc_info=True)
        finally:
            if fd >= 0:
                os.close(fd)
            with self._lock:
                self._busy = False


_SPARE = _SpareSegment()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
