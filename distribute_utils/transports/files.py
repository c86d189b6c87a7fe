"""Internal. File primitives of the shared workspace: atomic writes with an exact reservation, a reader that
survives a network filesystem's stale caches, the mount table.

- :func:`atomic_write` writes ``.<name>.tmp-<pid>-<random>`` (``O_EXCL``, 0600; through
  :func:`~distribute_utils.temporaries.write_atomically`, unrecorded), reserves its exact size first
  where the filesystem can (``fallocate``; a full disk or quota gives :class:`SpaceError` naming the path
  and the bytes needed), writes, ``fsync``s, and renames it: a reader never sees a half-written name.
- :func:`read_payload_file` opens a payload (retrying while an NFS client's lookup cache hides it),
  checks its length against the length its prefix states (retrying a short, stale view) and reads or
  maps it.
- :func:`filesystem_type` reads ``/proc/self/mounts``; :data:`LOCAL_FS` are the ones mapped, not copied.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import DistributeError, PayloadError, SpaceError, WorkspaceError
from ..temporaries import remove_file as unlink
from ..temporaries import write_atomically
from ..wire import PREFIX_SIZE, read_prefix

__all__ = [
    "LOCAL_FS",
    "atomic_write",
    "filesystem_type",
    "free_bytes",
    "read_payload_file",
    "reserve_space",
    "unlink",
    "write_error",
]

logger = logging.getLogger(__name__)

_BACKOFF_START_S = 0.001
_BACKOFF_MAX_S = 0.05
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_RESERVE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTTY)
#: Filesystems whose pages stay valid in a private mapping after the file is unlinked, and that no other
#: host writes to: the reader maps them instead of copying (3x faster here).
LOCAL_FS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs", "bcachefs", "jfs"}
)


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_error(exc: OSError, directory: str, nbytes: int | None, what: str) -> OSError:
    """Turn a failed write into an error that names the path, the size and what to do."""
    size = f"the {nbytes:,} bytes of {what}" if nbytes is not None else what
    if exc.errno in _NO_SPACE:
        free = free_bytes(directory)
        room = f" ({free:,} bytes free now)" if free is not None else ""
        return SpaceError(
            exc.errno,
            f"workspace {directory}{room} has no room for {size}: {os.strerror(exc.errno)}; "
            "free space or raise the quota there, or pass another workspace_path",
        )
    if exc.errno in _NOT_WRITABLE:
        return WorkspaceError(
            exc.errno,
            f"cannot write {size} to workspace {directory}: {os.strerror(exc.errno)}; the workspace "
            "must be a writable directory for this user on every node (is it mounted read-only?)",
        )
    return exc


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):  # pragma: no cover - not glibc/Linux
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _libc_fallocate()


def reserve_space(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` for ``fd``; False where the filesystem cannot (then plain writes).

    Calls ``fallocate(2)`` itself: glibc's ``posix_fallocate`` (what ``os.posix_fallocate``
    calls) emulates it on NFSv3 and FUSE by writing one byte per block, a second pass over
    the network.

    Raises:
        OSError: the filesystem has no room (``ENOSPC``, ``EDQUOT``) or another error.
    """
    if nbytes <= 0:
        return True
    if _FALLOCATE is None:  # pragma: no cover - not glibc/Linux
        return False
    if _FALLOCATE(fd, 0, 0, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_RESERVE:
        return False
    raise OSError(err, os.strerror(err))


def _unescape(field_: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """Type of the filesystem holding ``path`` (``"nfs4"``, ``"ext4"``, ``"fuse.sshfs"``...).

    Read from ``/proc/self/mountinfo``; ``"unknown"`` where that is not available.
    """
    real = os.path.realpath(os.fspath(path))
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown"
    best, found = "", "unknown"
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = _unescape(fields[4])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # later lines are mounted on top: take the last
            best, found = mount, right.split()[0]
    return found


def atomic_write(
    directory: str,
    name: str,
    write: Callable[[int], None],
    *,
    nbytes: int | None,
    what: str,
    fsync: bool = True,
    reserve: int | None = None,
    temps: set[str] | None = None,
) -> str:
    """Write a new file ``directory/name`` through a private temporary name, then rename.

    Args:
        directory: where the file goes.
        name: its final name; it must not exist yet (names are never rewritten).
        write: writes the content into the open file descriptor it is given.
        nbytes: exact size when known (reserved first, and named in errors).
        what: what the file holds, for error messages.
        fsync: ``fsync`` the content before the rename.
        reserve: bytes to reserve when the exact size is not known (truncated after).
        temps: a set this function records the temporary name in while it exists.

    Returns:
        The final path.

    Raises:
        SpaceError: no room; WorkspaceError: not writable; FileExistsError: the name exists.
    """
    final = os.path.join(directory, name)
    if os.path.lexists(final):
        raise FileExistsError(
            errno.EEXIST, f"{final} already exists: workspace names are never rewritten", final
        )
    size = nbytes if nbytes is not None else reserve

    def fill(fd: int) -> None:
        reserved = reserve_space(fd, size) if size else False
        write(fd)
        if reserved and nbytes is None:
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))  # drop the unused reservation

    try:
        write_atomically(final, fill, mode=0o600, fsync=fsync, record=False, temps=temps, remove=unlink)
    except OSError as exc:
        if isinstance(exc, DistributeError):
            raise
        raise write_error(exc, directory, size, what) from None
    return final


# -- reading -----------------------------------------------------------------------------------
@dataclass
class _Seen:
    """The last incomplete view of a file, for the timeout message."""

    size: int = -1
    expected: int = -1


def read_payload_file(
    path: str, *, deadline: float, use_mmap: bool, wait_missing: bool, what: str, timeout: float
) -> Any:
    """Read a payload file whole, retrying a missing or short view until ``deadline``.

    Returns:
        A ``bytearray`` (or a private ``mmap``) holding exactly the payload, or None when the
        file does not exist and ``wait_missing`` is False.

    Raises:
        PayloadError: still missing or short at the deadline, longer than its prefix says, or
            a corrupt prefix; the message names the path and the lengths.
    """
    seen = _Seen()
    delay = _BACKOFF_START_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not wait_missing:
                return None
        else:
            try:
                buf = _read_open(fd, path, seen, use_mmap, what)
            finally:
                os.close(fd)
            if buf is not None:
                return buf
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, _BACKOFF_MAX_S)
    if seen.size < 0:
        raise PayloadError(
            f"{what}: {path} did not appear within {timeout:g} s although its writer reported it "
            "written; check that the workspace is the same shared directory on every node (not a "
            "local directory of the same name) and see docs/multinode.md for NFS mount options"
        )
    raise PayloadError(
        f"{what}: {path} holds {seen.size} bytes but its payload says {seen.expected}; still short "
        f"after {timeout:g} s (a partial write, or a stale view of a network filesystem: see "
        "docs/multinode.md)"
    )


def _read_open(fd: int, path: str, seen: _Seen, use_mmap: bool, what: str) -> Any:
    """One attempt on an open file: the whole payload, or None for a short view."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, PREFIX_SIZE, 0)
    if len(head) < PREFIX_SIZE:
        seen.size, seen.expected = size, PREFIX_SIZE
        return None
    try:
        total = read_prefix(head).total_len
    except PayloadError as exc:
        raise PayloadError(f"{what}: {path}: {exc}") from None
    if size > total:
        raise PayloadError(
            f"{what}: {path} holds {size} bytes but its payload says {total}; the file is corrupt "
            "(or was written by something else)"
        )
    if size < total:
        seen.size, seen.expected = size, total
        return None
    if use_mmap:
        return mmap.mmap(fd, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf = bytearray(total)
    view = memoryview(buf)
    pos = 0
    while pos < total:
        got = os.readv(fd, [view[pos:]])
        if got == 0:
            break
        pos += got
    view.release()
    if pos < total:
        seen.size, seen.expected = pos, total
        return None
    return buf
