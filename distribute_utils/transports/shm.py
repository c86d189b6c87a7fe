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
import mmap
import os

from .._host import SHM_DIR
from ..errors import PayloadError, SpaceError
from ..wire import EncodedPayload, read_prefix

__all__ = ["SEGMENT_PREFIX", "SharedMemoryTransport", "segment_path"]

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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, payload.nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    size, free = shm_space()
                    raise SpaceError(
                        errno.ENOSPC,
                        f"{SHM_DIR} (size {size:,} bytes, {free:,} free now) cannot hold the "
                        f"{payload.nbytes:,} bytes of rank {rank}'s payload; enlarge {SHM_DIR} "
                        "(e.g. docker --shm-size) or pass a workspace_path",
                    ) from None
                raise
            payload.write_to_fd(fd)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)

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


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
