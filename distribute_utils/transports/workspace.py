"""Workspace transport: payloads as files in a directory every rank can reach (NFS, Lustre, ...).

Ranks on different hosts cannot share memory, so they meet in a shared directory. Every job
gets its own namespace ``<workspace>/du-job-<job_token>/`` (mode 0700), created by every rank
(never by one rank for the others: that is a race on the other nodes).

- ``publish`` writes the payload to ``.<token>_<rank>.du.tmp-<random>`` (``O_EXCL``, 0600),
  reserves its exact size first where the filesystem can (``fallocate``; a full disk or quota
  gives :class:`SpaceError` naming the path and the bytes needed), writes, ``fsync``s, closes
  and renames it to ``<token>_<rank>.du``. A reader never sees a half-written final name.
- ``fetch`` opens the final name (retrying while a network filesystem's lookup cache hides
  it, up to ``timeout``), checks the file's length against the length its prefix states
  (retrying a short, stale view), reads it into memory it owns, unlinks it and returns it;
  :func:`distribute_utils.wire.decode` then verifies the checksum.
- ``release`` removes whatever the sender left (idempotent).

Names are never rewritten: every round has a fresh token, so a client's cached attributes of
an old file can never be mistaken for a new one (NFS/FUSE clients cache sizes per name).

:class:`NFSWorkspace` is the ModelOpt-compatible face of the same directory (``torch.save`` /
``torch.load(weights_only=True)``); :func:`sweep_stale_namespaces` removes what crashed jobs
left, and runs once per process when a gather or an :class:`NFSWorkspace` opens the job's
namespace. See ``docs/multinode.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import pickle
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import filelock
import torch
import torch.distributed as dist

from .. import interrupts
from .._host import ProcessInfo, process_alive, this_process
from ..errors import DistributeError, PayloadError, SpaceError, WorkspaceError
from ..wire import FLAG_CHECKSUM, PREFIX_SIZE, EncodedPayload, decode, encode, read_prefix

__all__ = [
    "DEFAULT_SWEEP_AGE_S",
    "JOB_TOKEN_ENV",
    "JOB_TOKEN_KEY",
    "NAMESPACE_PREFIX",
    "NFSWorkspace",
    "WorkspaceError",
    "WorkspaceTransport",
    "close_namespaces",
    "filesystem_type",
    "job_token",
    "namespace_path",
    "sweep_stale_namespaces",
]

logger = logging.getLogger(__name__)

NAMESPACE_PREFIX = "du-job-"
"""Name prefix of a job's namespace directory inside the workspace."""
JOB_TOKEN_ENV = "DISTRIBUTE_UTILS_JOB_TOKEN"
"""Environment variable proposing the job token (must be unique per job)."""
JOB_TOKEN_KEY = "distribute_utils/job_token"
"""Key under which the ranks agree on the job token in the default store."""
DEFAULT_SWEEP_AGE_S = 24 * 3600.0
"""Namespaces with owners on other hosts are swept only when untouched for this long."""

_SUFFIX = ".du"
_OWNER_PREFIX = "owner-"
_TOKEN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_BACKOFF_START_S = 0.001
_BACKOFF_MAX_S = 0.05
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_RESERVE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTTY)
# Filesystems whose pages stay valid in a private mapping after the file is unlinked, and
# that no other host writes to: the reader maps them instead of copying (3x faster here).
_LOCAL_FS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs", "bcachefs", "jfs"}
)


# -- small helpers -------------------------------------------------------------------------------
def _check_token(token: str, what: str) -> str:
    if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
        raise ValueError(
            f"{what} {token!r:.80} is not usable in a file name: expected 1-128 characters "
            "from [A-Za-z0-9_-], not starting with '_' or '-'"
        )
    return token


def namespace_path(workspace_path: str | os.PathLike[str], job_token: str) -> str:
    """The namespace directory of job ``job_token`` inside ``workspace_path``."""
    return os.path.join(os.path.abspath(os.fspath(workspace_path)), NAMESPACE_PREFIX + job_token)


def _unlink(path: str) -> bool:
    """Remove ``path``; True once it is gone (a failure is logged, never raised)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)
        return False
    return True


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _write_error(exc: OSError, directory: str, nbytes: int | None, what: str) -> OSError:
    """Turn a failed write into an error that names the path, the size and what to do."""
    size = f"the {nbytes:,} bytes of {what}" if nbytes is not None else what
    if exc.errno in _NO_SPACE:
        free = _free_bytes(directory)
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


def _reserve(fd: int, nbytes: int) -> bool:
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


def _atomic_write(
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
    tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _write_error(exc, directory, nbytes, what) from None
    if temps is not None:
        temps.add(tmp)
    try:
        try:
            size = nbytes if nbytes is not None else reserve
            reserved = _reserve(fd, size) if size else False
            write(fd)
            if reserved and nbytes is None:
                os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))  # drop the unused reservation
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)  # NFS reports deferred write errors (ENOSPC, EDQUOT) here too
        os.rename(tmp, final)
    except BaseException as exc:
        if _unlink(tmp) and temps is not None:
            temps.discard(tmp)  # else ``release`` tries again
        if isinstance(exc, OSError) and not isinstance(exc, DistributeError):
            raise _write_error(exc, directory, nbytes if nbytes is not None else reserve, what) from None
        raise
    if temps is not None:
        temps.discard(tmp)
    return final


# -- reading -----------------------------------------------------------------------------------
@dataclass
class _Seen:
    """The last incomplete view of a file, for the timeout message."""

    size: int = -1
    expected: int = -1


def _read_payload_file(
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


# -- namespaces --------------------------------------------------------------------------------
def _user_dir(workspace: str) -> str:
    """This user's private directory in the workspace (``.du-<uid>``, mode 0700): its lock."""
    return os.path.join(workspace, f".du-{os.getuid()}")


def _lock_path(workspace: str) -> str:
    # One lock per user, inside a directory only that user can write: a lock file in the
    # shared workspace itself could be planted (a symlink to truncate, a file another user
    # owns or holds locked); here nobody else can create, replace or hold it.
    return os.path.join(_user_dir(workspace), "sweep.lock")


_FS_UIDS: dict[str, int] = {}


def _fs_uid(workspace: str) -> int:
    """The uid the workspace's filesystem gives this user's files (root squashing maps root to
    another uid on NFS): learnt once per process, from a file it creates and removes."""
    found = _FS_UIDS.get(workspace)
    if found is None:
        fd, path = tempfile.mkstemp(prefix=".du-uid-", dir=workspace)
        try:
            found = _FS_UIDS[workspace] = os.fstat(fd).st_uid
        finally:
            os.close(fd)
            _unlink(path)
    return found


def check_private_dir(path: str, what: str, workspace: str) -> None:
    """Refuse a directory another local or remote user could have made or could write into.

    It must be a real directory (not a symbolic link), owned by this user (as the filesystem
    maps it), with no group or other permission bits. Otherwise another user could read this
    job's files or put their own in place of a rank's payload.

    Raises:
        WorkspaceError: naming the path, its owner and mode, and how to fix it.
    """
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symbolic link (to {os.readlink(path)!r})"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid not in (os.geteuid(), _fs_uid(workspace) if st.st_uid != os.geteuid() else -1):
        problem = (
            f"belongs to uid {st.st_uid} ({_user_name(st.st_uid)}), not to this user (uid {os.geteuid()})"
        )
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    if problem is not None:
        raise WorkspaceError(
            errno.EPERM,
            f"{what} {path} {problem}: another user may have made it to read or replace this job's "
            "files, so it is not used. Remove it (as its owner or root); if the job token is "
            f"predictable, set ${JOB_TOKEN_ENV} to an unguessable value",
        )


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return "unknown user"


def _private_mkdir(path: str, what: str, workspace: str) -> None:
    """Make ``path`` (0700) unless it exists, then check that it is this user's, private."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # exact mode whatever the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise _write_error(exc, workspace, None, what) from None
    check_private_dir(path, what, workspace)


@contextlib.contextmanager
def _workspace_lock(workspace: str, timeout: float) -> Iterator[None]:
    _private_mkdir(_user_dir(workspace), "this user's lock directory", workspace)
    path = _lock_path(workspace)
    lock = filelock.FileLock(path, timeout=timeout, mode=0o600)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise WorkspaceError(
            errno.ETIMEDOUT,
            f"could not acquire lock on '{path}' within {timeout:g} s; another process of this user holds it",
        ) from None
    except OSError as exc:
        raise _write_error(exc, workspace, None, f"the lock file {path}") from None
    try:
        yield
    finally:
        lock.release()


def _prepare_workspace(workspace_path: str | os.PathLike[str]) -> str:
    """The workspace as an absolute path; created (one level only) when its parent exists."""
    path = os.path.abspath(os.fspath(workspace_path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise WorkspaceError(
                errno.ENOENT,
                f"workspace {path} does not exist and neither does its parent {parent}; create the "
                "shared directory (mount the network filesystem) on every node first",
            ) from None
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise _write_error(exc, parent, None, "the workspace directory") from None
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise WorkspaceError(
            errno.ENOTDIR,
            f"workspace {path} is not a directory; pass a directory that every node shares",
        )
    return path


def _owner_name(info: ProcessInfo) -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", info.hostname)[:64] or "host"
    return f"{_OWNER_PREFIX}{host}-{info.pid}.json"


def _owner_record(info: ProcessInfo) -> bytes:
    """The JSON owner record of process ``info``: what a sweeper needs to judge its liveness."""
    record = {
        "version": 1,
        "hostname": info.hostname,
        "boot_id": info.boot_id,
        "pid_namespace": info.pid_namespace,
        "pid": info.pid,
        "start_time": info.start_time,
        "uid": os.getuid(),
        "created": time.time(),
    }
    return json.dumps(record, sort_keys=True).encode()


class _Namespace:
    """A job's namespace as this process uses it: directory plus this process's owner record."""

    def __init__(self, workspace: str, token: str, path: str, owner: str, fs_type: str) -> None:
        self.workspace = workspace
        self.token = token
        self.path = path
        self.owner = owner
        self.fs_type = fs_type
        self.pid = os.getpid()
        self.closed = False
        self.locked = True  # created under this user's workspace lock (False: doctor's probe)


_NAMESPACES: dict[str, _Namespace] = {}
_NS_LOCK = threading.Lock()
_ATEXIT = False


def _open_namespace(
    workspace_path: str | os.PathLike[str], token: str, timeout: float, lock: bool = True
) -> _Namespace:
    """The job's namespace, created on first use in this process (every rank does it); refused
    when another user made it (see :func:`check_private_dir`). ``lock=False`` (doctor's probe,
    a namespace nobody else knows) leaves no lock behind."""
    _check_token(token, "job token")
    workspace = _prepare_workspace(workspace_path)
    path = namespace_path(workspace, token)
    with _NS_LOCK:
        ns = _NAMESPACES.get(path)
        if ns is not None and not ns.closed and ns.pid == os.getpid():
            return ns
        info = this_process()
        owner = os.path.join(path, _owner_name(info))
        data = _owner_record(info)
        with _workspace_lock(workspace, timeout) if lock else contextlib.nullcontext():
            for attempt in range(3):  # another host may rmdir an empty namespace meanwhile
                try:
                    _private_mkdir(path, "the job's namespace directory", workspace)
                except FileNotFoundError:
                    continue
                _unlink(owner)
                try:
                    _atomic_write(
                        path,
                        os.path.basename(owner),
                        lambda fd: _write_all(fd, data),
                        nbytes=len(data),
                        what="the owner record",
                    )
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        ns = _Namespace(workspace, token, path, owner, filesystem_type(path))
        ns.locked = lock
        _NAMESPACES[path] = ns
        global _ATEXIT
        if not _ATEXIT:
            atexit.register(close_namespaces)
            interrupts.on_interrupt(lambda: close_namespaces(timeout=5.0))
            _ATEXIT = True
    logger.debug("workspace namespace %s ready (%s)", path, ns.fs_type)
    return ns


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _close_namespace(ns: _Namespace, timeout: float = 60.0) -> None:
    """Remove this process's owner record, and the namespace when nothing else is left in it."""
    with _NS_LOCK:
        if ns.closed or ns.pid != os.getpid():
            return
        ns.closed = True
        _NAMESPACES.pop(ns.path, None)
        for key, state in _WORKSPACE_STATES.items():
            if key[0] == ns.path:  # counters stay: a reopened namespace never reuses a name
                state.remove_last()
    if not os.path.isdir(ns.path):
        return  # already gone (swept, or the whole workspace was removed)
    try:
        with _workspace_lock(ns.workspace, timeout) if ns.locked else contextlib.nullcontext():
            _unlink(ns.owner)
            try:
                os.rmdir(ns.path)
                logger.debug("removed the empty namespace %s", ns.path)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
                    raise
    except OSError:
        logger.warning("could not clean up the workspace namespace %s", ns.path, exc_info=True)


def close_namespaces(timeout: float = 60.0) -> None:
    """Leave every namespace this process opened (runs at exit and on an interrupt; safe to call any time).

    Removes this process's owner records and its last :class:`NFSWorkspace` files, and each
    namespace directory that is then empty. Call it on every rank after the last gather.
    ``timeout`` bounds each wait for the workspace lock.
    """
    with _NS_LOCK:
        opened = list(_NAMESPACES.values())
    for ns in opened:
        _close_namespace(ns, timeout)


# -- job token ---------------------------------------------------------------------------------
_TOKEN_CACHE: dict[str, Any] = {}


def job_token() -> str:
    """The job's token, the same on every rank; cached per process.

    Under ``torch.distributed``, ranks agree through the default store: every rank proposes
    ``$DISTRIBUTE_UTILS_JOB_TOKEN`` or a fresh random token with ``compare_set`` and the first
    proposal wins. Without it, the environment variable or a fresh token for this process.

    Raises:
        ValueError: the environment variable holds characters unusable in a file name.
    """
    store = (
        dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None
    )
    cached = _TOKEN_CACHE.get("token")
    if cached is not None and _TOKEN_CACHE.get("store") is store:
        return cached
    candidate = os.environ.get(JOB_TOKEN_ENV) or secrets.token_hex(16)
    _check_token(candidate, f"${JOB_TOKEN_ENV}")
    if store is not None:
        winner = store.compare_set(JOB_TOKEN_KEY, "", candidate)
        token = _check_token(bytes(winner).decode(), "job token in the store")
    else:
        token = candidate
    _TOKEN_CACHE.update(token=token, store=store)
    return token


# -- the transport -----------------------------------------------------------------------------
ReadMode = Literal["auto", "read", "mmap"]


class WorkspaceTransport:
    """Moves payloads through files in a shared directory (see module doc).

    Args:
        workspace_path: a directory every participating rank reaches (an NFS mount...); created
            when missing if its parent exists.
        job_token: the job's namespace token, the same on every rank (:func:`job_token`).
        timeout: how long ``fetch`` waits for a file to appear whole, in seconds.
        fsync: ``fsync`` each file before renaming it into place.
        read_mode: ``"mmap"`` maps files privately (zero-copy; local filesystems only),
            ``"read"`` copies them into memory, ``"auto"`` maps on local filesystems and reads
            on network ones.
        sweep_stale: once per process and workspace, remove the namespaces of dead jobs
            (:func:`sweep_stale_namespaces`; failures are logged, not raised). The gather
            functions and :class:`NFSWorkspace` do this when they open a job's namespace.
        lock: take this user's workspace lock to create the namespace (False: a private
            probe namespace no other process knows, as ``doctor`` uses; nothing is left).

    Raises:
        WorkspaceError: the workspace is missing (parent too), not a directory, not writable.
    """

    name = "workspace"

    def __init__(
        self,
        workspace_path: str | os.PathLike[str],
        job_token: str,
        timeout: float,
        *,
        fsync: bool = True,
        read_mode: ReadMode = "auto",
        sweep_stale: bool = False,
        lock: bool = True,
    ) -> None:
        if read_mode not in ("auto", "read", "mmap"):
            raise ValueError(f"read_mode must be 'auto', 'read' or 'mmap'; got {read_mode!r}")
        self._ns = _open_namespace(workspace_path, job_token, timeout, lock)
        if sweep_stale:
            _sweep_once(self._ns.workspace, timeout)
        self._timeout = float(timeout)
        self._fsync = fsync
        self._mmap = read_mode == "mmap" or (read_mode == "auto" and self._ns.fs_type in _LOCAL_FS)
        self._temps: dict[tuple[str, int], set[str]] = {}

    def _open(self) -> _Namespace:
        """The namespace, joined again if this process left it meanwhile (``close``)."""
        if self._ns.closed or self._ns.pid != os.getpid():
            self._ns = _open_namespace(self._ns.workspace, self._ns.token, self._timeout)
        return self._ns

    @property
    def namespace(self) -> str:
        """The job's namespace directory."""
        return self._ns.path

    def path(self, token: str, rank: int) -> str:
        """Final path of the payload ``rank`` publishes in round ``token``."""
        _check_token(token, "round token")
        return os.path.join(self._ns.path, f"{token}_{int(rank)}{_SUFFIX}")

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> None:
        if not read_prefix(payload.head).flags & FLAG_CHECKSUM:
            raise ValueError(
                "the workspace transport needs payloads encoded with checksum=True "
                "(a network filesystem may serve stale or partial bytes)"
            )
        final = self.path(token, rank)
        temps = self._temps.setdefault((token, rank), set())
        _atomic_write(
            self._open().path,
            os.path.basename(final),
            payload.write_to_fd,
            nbytes=payload.nbytes,
            what=f"rank {rank}'s payload",
            fsync=self._fsync,
            temps=temps,
        )
        if not temps:
            del self._temps[(token, rank)]

    def fetch(self, token: str, rank: int) -> Any:
        path = self.path(token, rank)
        buf = _read_payload_file(
            path,
            deadline=time.monotonic() + self._timeout,
            use_mmap=self._mmap,
            wait_missing=True,
            what=f"payload of rank {rank}",
            timeout=self._timeout,
        )
        _unlink(path)
        return buf

    def release(self, token: str, rank: int) -> None:
        _unlink(self.path(token, rank))
        for tmp in self._temps.pop((token, rank), ()):
            _unlink(tmp)

    def close(self) -> None:
        """Leave the namespace: remove this process's owner record, and the directory if empty.

        Call once on every rank after the job's last gather (it also runs at exit).
        """
        _close_namespace(self._ns, self._timeout)

    def __enter__(self) -> WorkspaceTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- ModelOpt-compatible workspace -------------------------------------------------------------
_ENVELOPE = "distribute_utils.nfs_workspace/1"


@dataclass
class _RankState:
    """One rank's writes in one namespace, shared by every NFSWorkspace of the process."""

    namespace: str
    rank: int
    writes: int = 0  # the number of this rank's next write (continues across NFSWorkspace objects)
    last: list[str] = field(default_factory=list)
    seen: dict[int, int] = field(default_factory=dict)  # the latest write found, per rank read

    def remove_last(self) -> None:
        for path in self.last:
            _unlink(path)
        self.last = []


_WORKSPACE_STATES: dict[tuple[str, int], _RankState] = {}


class _RecordingWriter:
    """A file object for ``torch.save`` that keeps the ``OSError`` torch turns into RuntimeError."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _save_weights(weights: Any, fd: int) -> None:
    with open(fd, "wb", closefd=False) as f:
        out = _RecordingWriter(f)
        try:
            torch.save(weights, out)  # type: ignore[arg-type]
            f.flush()
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise


def _storage_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor storage in ``obj`` (what ``torch.save`` writes)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes() + 1024
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total + 64 * 1024


class NFSWorkspace:
    """ModelOpt-compatible shared workspace: configs and weights per rank, as files.

    Drop-in for ``modelopt.torch.export.distribute.NFSWorkspace``, with its observable
    behaviour: making one removes this rank's earlier state; a read returns the target rank's
    latest write (``(None, None)`` when it has none), as often as it is asked; a new write
    replaces the rank's previous one. Reads and writes involve no collective and no barrier:
    the caller synchronises all ranks (write, barrier, read, barrier), as with ModelOpt.

    Kept from us, unlike ModelOpt's plain ``rank_<r>_state.pth``: every write goes to fresh
    names (a network filesystem's cached attributes of an old file can never be taken for a
    new one), appears atomically (temp + fsync + rename, the config last), carries a checksum,
    and is read without unpickling anything (the config as a wire payload, the weights with
    ``torch.load(weights_only=True)``), in the job's private namespace
    ``<workspace>/du-job-<token>/`` (:attr:`namespace`).

    Attributes:
        path: the workspace directory, as given (ModelOpt's meaning).
        namespace: the job's directory inside it, where the files are.
        rank: this process's global rank.

    Args:
        workspace_path: the shared directory; None leaves the workspace uninitialised.
    """

    def __init__(self, workspace_path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path("") if workspace_path is None else Path(workspace_path)
        self.namespace: Path | None = None
        self._state: _RankState | None = None
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if workspace_path is None:
            return
        from ..sync import resolve_timeout

        self._timeout = resolve_timeout(None)
        self._ns = _open_namespace(workspace_path, job_token(), self._timeout)
        _sweep_once(self._ns.workspace, self._timeout)
        self.namespace = Path(self._ns.path)
        self._mmap = self._ns.fs_type in _LOCAL_FS
        key = (self._ns.path, self.rank)
        with _NS_LOCK:
            self._state = _WORKSPACE_STATES.setdefault(key, _RankState(self._ns.path, self.rank))
            self._state.last = []
            self._remove_own_files()  # ModelOpt's _clean_up() at construction

    @property
    def is_initialized(self) -> bool:
        """Whether a workspace path was given."""
        return self._state is not None

    @property
    def state_path(self) -> Path:
        """This rank's latest config file (a name that does not exist before its first write)."""
        state = self._require()
        latest = self._latest(self.rank)
        name = self._names(self.rank, latest)[0] if latest is not None else f"ws-r{self.rank}-unwritten"
        return Path(state.namespace, name)

    def _names(self, rank: int, write: int) -> tuple[str, str]:
        stem = f"ws-r{rank}-w{write}"
        return f"{stem}.config{_SUFFIX}", f"{stem}.weights.pt"

    def _remove_own_files(self) -> None:
        """Remove this rank's state: earlier writes, and leftovers of an earlier process."""
        prefix = f"ws-r{self.rank}-w"
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self._ns.path):
                if name.startswith(prefix):
                    _unlink(os.path.join(self._ns.path, name))

    def _require(self) -> _RankState:
        if self._state is None:
            raise ValueError("NFSWorkspace is not initialized: pass a workspace_path")
        if self._ns.closed or self._ns.pid != os.getpid():  # rejoin after close()
            self._ns = _open_namespace(self._ns.workspace, self._ns.token, self._timeout)
        return self._state

    def write_configs_and_weights(self, config_json: Any, weights: dict[str, Any] | None) -> None:
        """Write this rank's config and weights; they replace its previous write.

        Args:
            config_json: the config: JSON-like values, tuples, dataclasses and tensors.
            weights: a state dict (tensors and plain containers), or None.

        Raises:
            TypeError: the config holds a value that cannot be encoded (the path is named).
            SpaceError: the workspace has no room; WorkspaceError: it is not writable.
        """
        state = self._require()
        k = state.writes
        config_name, weights_name = self._names(self.rank, k)
        kind = "none" if weights is None else "file"
        envelope = {
            "format": _ENVELOPE,
            "rank": self.rank,
            "write": k,
            "config": config_json,
            "weights": kind,
        }
        payload = encode(envelope, root="config_json", checksum=True)
        made: list[str] = []
        try:
            if kind == "file":
                made.append(
                    _atomic_write(
                        self._ns.path,
                        weights_name,
                        lambda fd: _save_weights(weights, fd),
                        nbytes=None,
                        reserve=_storage_bytes(weights),
                        what=f"rank {self.rank}'s weights",
                    )
                )
            # The config goes last: once it exists, the write is complete.
            made.append(
                _atomic_write(
                    self._ns.path,
                    config_name,
                    payload.write_to_fd,
                    nbytes=payload.nbytes,
                    what=f"rank {self.rank}'s config",
                )
            )
        except BaseException:
            for path in made:
                _unlink(path)
            raise
        state.remove_last()
        state.last = made
        state.writes = k + 1

    def _exists(self, rank: int, write: int) -> bool:
        # A lookup of one name is revalidated by NFS / FUSE clients; a cached directory
        # listing may hide a new file for many seconds.
        return os.path.exists(os.path.join(self._ns.path, self._names(rank, write)[0]))

    def _listed(self, rank: int) -> int | None:
        pattern = re.compile(rf"ws-r{int(rank)}-w(\d+)\.config{re.escape(_SUFFIX)}")
        try:
            names = os.listdir(self._ns.path)
        except FileNotFoundError:
            return None
        found = [int(m.group(1)) for n in names if (m := pattern.fullmatch(n))]
        return max(found) if found else None

    def _latest(self, rank: int) -> int | None:
        """The number of ``rank``'s latest complete write: from the last one this process found
        (or a listing, the first time), probing the next names one by one."""
        state = self._require()
        start = state.seen.get(rank)
        if start is None or not self._exists(rank, start):
            listed = self._listed(rank)
            start = max(start if start is not None else -1, listed if listed is not None else -1)
            if start < 0 and not self._exists(rank, 0):
                return None
            start = max(start, 0)
        k = start
        while self._exists(rank, k + 1):
            k += 1
        if not self._exists(rank, k):
            return None
        state.seen[rank] = k
        return k

    def read_configs_and_weights_from_rank(self, target_rank: int) -> tuple[Any, Any]:
        """Rank ``target_rank``'s latest write: ``(config, weights)``, or ``(None, None)``.

        Raises:
            PayloadError: a file is corrupt or truncated, or the weights are not a plain state
                dict (``torch.load(weights_only=True)`` refused them).
        """
        self._require()
        target = int(target_rank)
        deadline = time.monotonic() + self._timeout
        while True:
            k = self._latest(target)
            if k is None:
                return None, None
            config_name, weights_name = self._names(target, k)
            config_path = os.path.join(self._ns.path, config_name)
            buf = _read_payload_file(
                config_path,
                deadline=deadline,
                use_mmap=False,
                wait_missing=False,
                what=f"config of rank {target}",
                timeout=self._timeout,
            )
            if buf is not None:
                try:
                    envelope = decode(buf)
                except PayloadError as exc:
                    raise PayloadError(f"config {config_path} of rank {target}: {exc}") from None
                if (
                    not isinstance(envelope, dict)
                    or envelope.get("format") != _ENVELOPE
                    or envelope.get("rank") != target
                    or envelope.get("write") != k
                ):
                    raise PayloadError(
                        f"config {config_path} is not write {k} of rank {target} in NFSWorkspace format"
                    )
                if envelope["weights"] != "file":
                    return envelope["config"], None
                weights = self._load_weights(
                    os.path.join(self._ns.path, weights_name), target, missing_ok=True
                )
                if weights is not None:
                    return envelope["config"], weights
            # Superseded by a newer write while we read: read that one.
            if time.monotonic() > deadline:
                raise PayloadError(
                    f"rank {target}'s write {k} disappeared while it was read, for {self._timeout:g} s; "
                    "synchronise writes and reads (barrier) as with ModelOpt's NFSWorkspace"
                )

    def _load_weights(self, path: str, target: int, missing_ok: bool = False) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=self._mmap)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise PayloadError(
                f"weights {path} of rank {target} are missing although its config exists"
            ) from None
        except pickle.UnpicklingError as exc:
            raise PayloadError(
                f"refusing to load weights {path} of rank {target}: they are not a plain state dict "
                f"of tensors and containers (torch.load with weights_only=True rejected them: "
                f"{str(exc).splitlines()[0]}); NFSWorkspace never unpickles arbitrary objects "
                "from a shared directory"
            ) from None
        except (RuntimeError, EOFError, ValueError) as exc:
            raise PayloadError(f"weights {path} of rank {target} are unreadable: {exc}") from None

    def close(self) -> None:
        """Remove this rank's last files and leave the namespace (after the last read, everywhere)."""
        if self._state is not None:
            _close_namespace(self._ns, self._timeout)


# -- sweeping ----------------------------------------------------------------------------------
def _owner_records(path: str) -> tuple[list[dict[str, Any]], int, float]:
    """Owner records, unreadable-record count and newest mtime of a namespace."""
    owners: list[dict[str, Any]] = []
    unreadable = 0
    newest = os.lstat(path).st_mtime
    for entry in os.scandir(path):
        with contextlib.suppress(FileNotFoundError):
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        if entry.name.startswith(_OWNER_PREFIX) and entry.name.endswith(".json"):
            try:
                with open(entry.path, encoding="utf-8") as f:
                    record = json.load(f)
                ProcessInfo(
                    str(record["hostname"]),
                    str(record["boot_id"]),
                    -1,
                    int(record["pid_namespace"]),
                    int(record["pid"]),
                    int(record["start_time"]),
                )
                owners.append(record)
            except (OSError, ValueError, KeyError, TypeError):
                unreadable += 1
    return owners, unreadable, newest


def owner_process(record: dict[str, Any]) -> ProcessInfo:
    """The process an owner record describes (its /dev/shm device is not recorded: -1)."""
    return ProcessInfo(
        str(record["hostname"]),
        str(record["boot_id"]),
        -1,
        int(record["pid_namespace"]),
        int(record["pid"]),
        int(record["start_time"]),
    )


def _judge(path: str, me: ProcessInfo, max_age: float, now: float) -> str | None:
    """Why the namespace at ``path`` can be removed, or None to keep it."""
    owners, unreadable, newest = _owner_records(path)
    local, remote = [], []
    for r in owners:
        info = owner_process(r)
        (local if me.can_watch(info) else remote).append(info)
    if any(process_alive(info) for info in local):
        return None
    if local and not remote and not unreadable:
        pids = ", ".join(str(i.pid) for i in local)
        return f"every owner ran on this host and has exited (pids {pids})"
    age = now - newest
    if age > max_age:
        hosts = sorted({i.hostname for i in remote})
        who = f"owners on {', '.join(hosts)}" if hosts else "no readable owner record"
        return f"untouched for {age / 3600:.1f} h (more than {max_age / 3600:g} h; {who})"
    return None


def sweep_stale_namespaces(
    workspace_path: str | os.PathLike[str],
    dry_run: bool = False,
    *,
    max_age: float = DEFAULT_SWEEP_AGE_S,
    timeout: float = 60.0,
) -> list[tuple[str, str]]:
    """Remove the namespaces crashed jobs left in ``workspace_path``.

    A namespace goes when every owner record in it belongs to a process of this host (same
    boot id and pid namespace) that has exited, or, when owners ran elsewhere (or no record
    is readable), when nothing in it changed for ``max_age`` seconds. A live job's namespace
    is never removed. Runs under the workspace's lock, as namespace creation does.

    Args:
        workspace_path: the workspace directory.
        dry_run: only report what would be removed.
        max_age: age in seconds after which namespaces with remote owners are stale.
        timeout: how long to wait for the workspace lock.

    Returns:
        ``(path, reason)`` for every namespace removed (or that would be, when ``dry_run``).
    """
    workspace = os.path.abspath(os.fspath(workspace_path))
    if not os.path.isdir(workspace):
        raise WorkspaceError(errno.ENOTDIR, f"workspace {workspace} is not a directory")
    me = this_process()
    now = time.time()
    found: list[tuple[str, str]] = []
    # A dry run changes nothing, not even the lock file (a read-only user may run it).
    with contextlib.nullcontext() if dry_run else _workspace_lock(workspace, timeout):
        for entry in sorted(os.scandir(workspace), key=lambda e: e.name):
            if not entry.name.startswith(NAMESPACE_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            with _NS_LOCK:
                mine = entry.path in _NAMESPACES
            if mine:
                continue
            try:
                reason = _judge(entry.path, me, max_age, now)
            except OSError as exc:
                logger.warning("cannot inspect %s: %s", entry.path, exc)
                continue
            if reason is None:
                continue
            if not dry_run:
                try:
                    shutil.rmtree(entry.path)
                except OSError as exc:
                    logger.warning("could not remove stale namespace %s: %s", entry.path, exc)
                    continue
                logger.info("removed stale namespace %s: %s", entry.path, reason)
            found.append((entry.path, reason))
    return found


_SWEPT: set[str] = set()


def _sweep_once(workspace: str, timeout: float) -> None:
    """Sweep ``workspace`` for dead jobs' namespaces, once per process; never raises.

    Called when a job opens its namespace (after it exists, so the sweep skips it), so what a
    crashed job left is removed by the next job that uses the workspace.
    """
    with _NS_LOCK:
        if workspace in _SWEPT:
            return
        _SWEPT.add(workspace)
    try:
        removed = sweep_stale_namespaces(workspace, timeout=timeout)
    except (OSError, DistributeError) as exc:
        logger.warning("could not sweep stale namespaces in %s: %s", workspace, exc)
        return
    if removed:
        logger.info("swept %d stale namespace(s) of dead jobs from %s", len(removed), workspace)
