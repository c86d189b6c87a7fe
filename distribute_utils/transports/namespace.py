"""Internal. Job namespaces in a shared workspace: private directories, owner records, the job token, the sweep.

Every job gets its own namespace ``<workspace>/du-job-<job_token>/`` (mode 0700, inside a directory
private to the user), created by every rank (never by one rank for the others: that is a race on the
other nodes). Each process that opens it leaves an owner record (host, pid, start time), removed when it
closes the namespace (at exit, or on an interrupt); the last one out removes the directory.
:func:`sweep_stale_namespaces` removes namespaces whose owners are all dead (or, with owners on other
hosts, untouched for :data:`DEFAULT_SWEEP_AGE_S`); ``doctor`` and ``clean`` read them with
:func:`owner_records` and :func:`judge`. :func:`job_token` is the token every rank agrees on.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import filelock
import torch.distributed as dist

from .. import interrupts
from ..caches import Recent
from ..errors import ArgumentError, DistributeError, WorkspaceError
from ..host_dir import not_private
from ..owners import owned, process_owned
from ..processes import ProcessInfo, process_alive, this_process
from .files import atomic_write, filesystem_type, unlink, write_error

__all__ = [
    "DEFAULT_SWEEP_AGE_S",
    "FILE_SUFFIX",
    "JOB_TOKEN_ENV",
    "JOB_TOKEN_KEY",
    "NAMESPACE_PREFIX",
    "JobToken",
    "Namespace",
    "Namespaces",
    "check_token",
    "close_namespace",
    "close_namespaces",
    "forget_job_token",
    "job_token",
    "judge",
    "namespace_path",
    "on_namespace_close",
    "open_namespace",
    "owner_process",
    "owner_records",
    "sweep_once",
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
FILE_SUFFIX = ".du"
"""Suffix of the payload files in a namespace."""

_OWNER_PREFIX = "owner-"
_TOKEN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


# -- small helpers -------------------------------------------------------------------------------
def check_token(token: str, what: str) -> str:
    if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
        raise ArgumentError(
            f"{what} {token!r:.80} is not usable in a file name: expected 1-128 characters "
            "from [A-Za-z0-9_-], not starting with '_' or '-'"
        )
    return token


def namespace_path(workspace_path: str | os.PathLike[str], job_token: str) -> str:
    """The namespace directory of job ``job_token`` inside ``workspace_path``."""
    return os.path.join(os.path.abspath(os.fspath(workspace_path)), NAMESPACE_PREFIX + job_token)


# -- namespaces --------------------------------------------------------------------------------
def user_dir(workspace: str) -> str:
    """This user's private directory in the workspace (``.du-<uid>``, mode 0700): its lock."""
    return os.path.join(workspace, f".du-{os.getuid()}")


def lock_path(workspace: str) -> str:
    # One lock per user, inside a directory only that user can write: a lock file in the
    # shared workspace itself could be planted (a symlink to truncate, a file another user
    # owns or holds locked); here nobody else can create, replace or hold it.
    return os.path.join(user_dir(workspace), "sweep.lock")


_FS_UIDS: Recent[str, int] = Recent(64)  # a memo: workspace -> the uid its filesystem gives our files


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
            unlink(path)
    return found


def check_private_dir(path: str, what: str, workspace: str) -> None:
    """Refuse a directory another local or remote user could have made or could write into.

    It must be a real directory (not a symbolic link), owned by this user (as the filesystem
    maps it), with no group or other permission bits. Otherwise another user could read this
    job's files or put their own in place of a rank's payload.

    Raises:
        WorkspaceError: naming the path, its owner and mode, and how to fix it.
    """
    owner = os.lstat(path).st_uid
    # (the uid the filesystem gives this user's files is learnt only when it matters: a root-squashed NFS)
    problem = not_private(path, (os.geteuid(), _fs_uid(workspace) if owner != os.geteuid() else -1))
    if problem is not None:
        raise WorkspaceError(
            errno.EPERM,
            f"{what} {path} {problem}: another user may have made it to read or replace this job's "
            "files, so it is not used. Remove it (as its owner or root); if the job token is "
            f"predictable, set ${JOB_TOKEN_ENV} to an unguessable value",
        )


def private_mkdir(path: str, what: str, workspace: str) -> None:
    """Make ``path`` (0700) unless it exists, then check that it is this user's, private."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # exact mode whatever the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise write_error(exc, workspace, None, what) from None
    check_private_dir(path, what, workspace)


@contextlib.contextmanager
def workspace_lock(workspace: str, timeout: float) -> Iterator[None]:
    private_mkdir(user_dir(workspace), "this user's lock directory", workspace)
    path = lock_path(workspace)
    lock = filelock.FileLock(path, timeout=timeout, mode=0o600)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise WorkspaceError(
            errno.ETIMEDOUT,
            f"could not acquire lock on '{path}' within {timeout:g} s; another process of this user holds it",
        ) from None
    except OSError as exc:
        raise write_error(exc, workspace, None, f"the lock file {path}") from None
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
            raise write_error(exc, parent, None, "the workspace directory") from None
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


def owner_record(info: ProcessInfo) -> bytes:
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


class Namespace:
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


class Namespaces:
    """The namespaces this process has open (process-wide: ``process_owned(Namespaces)``; left at exit
    or on an interrupt, not with a group: a namespace's file names are never reused by a process),
    what uses them, and the workspaces swept."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened: dict[str, Namespace] = {}
        self.close_hooks: list[Callable[[str], None]] = []
        self.swept: set[str] = set()
        self.exit_hooked = False


def open_namespace(
    workspace_path: str | os.PathLike[str], token: str, timeout: float, lock: bool = True
) -> Namespace:
    """The job's namespace, created on first use in this process (every rank does it); refused
    when another user made it (see :func:`check_private_dir`). ``lock=False`` (doctor's probe,
    a namespace nobody else knows) leaves no lock behind."""
    check_token(token, "job token")
    workspace = _prepare_workspace(workspace_path)
    path = namespace_path(workspace, token)
    state = process_owned(Namespaces)
    with state.lock:
        ns = state.opened.get(path)
        if ns is not None and not ns.closed and ns.pid == os.getpid():
            return ns
        info = this_process()
        owner = os.path.join(path, _owner_name(info))
        data = owner_record(info)
        with workspace_lock(workspace, timeout) if lock else contextlib.nullcontext():
            for attempt in range(3):  # another host may rmdir an empty namespace meanwhile
                try:
                    private_mkdir(path, "the job's namespace directory", workspace)
                except FileNotFoundError:
                    continue
                unlink(owner)
                try:
                    atomic_write(
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
        ns = Namespace(workspace, token, path, owner, filesystem_type(path))
        ns.locked = lock
        state.opened[path] = ns
        if not state.exit_hooked:
            atexit.register(close_namespaces)
            interrupts.on_interrupt(lambda: close_namespaces(timeout=5.0))
            state.exit_hooked = True
    logger.debug("workspace namespace %s ready (%s)", path, ns.fs_type)
    return ns


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def on_namespace_close(hook: Callable[[str], None]) -> None:
    """Registers ``hook(path)``: called when this process leaves the namespace ``path``, so that what uses
    the namespace (:class:`~distribute_utils.transports.nfs_workspace.NFSWorkspace`) removes its files."""
    state = process_owned(Namespaces)
    with state.lock:
        if hook not in state.close_hooks:
            state.close_hooks.append(hook)


def close_namespace(ns: Namespace, timeout: float = 60.0) -> None:
    """Remove this process's owner record, and the namespace when nothing else is left in it."""
    state = process_owned(Namespaces)
    with state.lock:
        if ns.closed or ns.pid != os.getpid():
            return
        ns.closed = True
        state.opened.pop(ns.path, None)
        for hook in state.close_hooks:
            hook(ns.path)
    if not os.path.isdir(ns.path):
        return  # already gone (swept, or the whole workspace was removed)
    try:
        with workspace_lock(ns.workspace, timeout) if ns.locked else contextlib.nullcontext():
            unlink(ns.owner)
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

    Removes this process's owner records (and, through :func:`on_namespace_close`, its last
    ``NFSWorkspace`` files), and each
    namespace directory that is then empty. Call it on every rank after the last gather.
    ``timeout`` bounds each wait for the workspace lock.
    """
    state = process_owned(Namespaces)
    with state.lock:
        opened = list(state.opened.values())
    for ns in opened:
        close_namespace(ns, timeout)


# -- job token ---------------------------------------------------------------------------------
class JobToken:
    """The job's token once agreed: one per default process group (``owned(JobToken)``: its store is
    the group's), the process's when there is none."""

    token: str | None = None


def forget_job_token() -> None:
    """Forget the token :func:`job_token` agreed in this group (or process): the next call agrees anew
    (reads the environment again: tests, tools)."""
    owned(JobToken).token = None


def job_token() -> str:
    """The job's token, the same on every rank; kept for the default process group (see :class:`JobToken`).

    Under ``torch.distributed``, ranks agree through the default store: every rank proposes
    ``$DISTRIBUTE_UTILS_JOB_TOKEN`` or a fresh random token with ``compare_set`` and the first
    proposal wins. Without it, the environment variable or a fresh token for this process.

    Raises:
        ValueError: the environment variable holds characters unusable in a file name.
    """
    held = owned(JobToken)
    if held.token is not None:
        return held.token
    store = (
        dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None
    )
    candidate = os.environ.get(JOB_TOKEN_ENV) or secrets.token_hex(16)
    check_token(candidate, f"${JOB_TOKEN_ENV}")
    if store is not None:
        winner = store.compare_set(JOB_TOKEN_KEY, "", candidate)
        token = check_token(bytes(winner).decode(), "job token in the store")
    else:
        token = candidate
    held.token = token
    return token


# -- sweeping ----------------------------------------------------------------------------------
def owner_records(path: str) -> tuple[list[dict[str, Any]], int, float]:
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
                owner_process(record)  # a record that does not describe a process is unreadable
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


def judge(path: str, me: ProcessInfo, max_age: float, now: float) -> str | None:
    """Why the namespace at ``path`` can be removed, or None to keep it."""
    owners, unreadable, newest = owner_records(path)
    local: list[ProcessInfo] = []
    remote: list[ProcessInfo] = []
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
    with contextlib.nullcontext() if dry_run else workspace_lock(workspace, timeout):
        for entry in sorted(os.scandir(workspace), key=lambda e: e.name):
            if not entry.name.startswith(NAMESPACE_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            state = process_owned(Namespaces)
            with state.lock:
                mine = entry.path in state.opened
            if mine:
                continue
            try:
                reason = judge(entry.path, me, max_age, now)
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


def sweep_once(workspace: str, timeout: float) -> None:
    """Sweep ``workspace`` for dead jobs' namespaces, once per process; never raises.

    Called when a job opens its namespace (after it exists, so the sweep skips it), so what a
    crashed job left is removed by the next job that uses the workspace.
    """
    state = process_owned(Namespaces)
    with state.lock:
        if workspace in state.swept:
            return
        state.swept.add(workspace)
    try:
        removed = sweep_stale_namespaces(workspace, timeout=timeout)
    except (OSError, DistributeError) as exc:
        logger.warning("could not sweep stale namespaces in %s: %s", workspace, exc)
        return
    if removed:
        logger.info("swept %d stale namespace(s) of dead jobs from %s", len(removed), workspace)
