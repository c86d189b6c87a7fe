"""Internal. The local-disk carrier: a payload in a file on this host's disk, for a ``/dev/shm`` too small.

Containers often get a small ``/dev/shm`` (Docker's default is 64 MiB) and a large disk. Where a segment
cannot be had (:class:`~distribute_utils.errors.SpaceError`), a sender on its first rank's host
publishes its payload here instead of failing, with the same exactness, owner checks and clean-up as a
named shared-memory segment: a file ``du_<token>_<rank>_<pid>`` (mode 0600, its size reserved before
anything is written) in this user's private directory under the local directory, which the first rank
maps copy-on-write and unlinks at once. The pages live in the page cache: written once, read once,
written back to the disk only if memory is short.

Settings: ``$DISTRIBUTE_UTILS_LOCAL_DIR``, the local directory (default: the system's temporary
directory, ``$TMPDIR`` or ``/tmp``); its subdirectory ``.distribute-utils-<uid>`` (mode 0700, checked as
:mod:`distribute_utils.host_dir` checks ``/dev/shm``'s) holds the files. Use a directory on a local
disk: on a network filesystem the workspace carrier is the right one.

Leftovers: a sender killed between publishing and its first rank's fetch leaves its file, named with its
pid; :meth:`LocalDiskCarrier.remove_left_by` (the first rank, when it sees the sender die;
``distribute-utils clean``) removes the files of processes that are gone, and an interrupted process its
own.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Any

from .. import host_dir, interrupts
from ..errors import PayloadError, SpaceError, TransportUnavailableError
from ..processes import ProcessInfo, process_alive
from ..wire import EncodedPayload, stated_length
from .base import Context, Destination, removed_on_interrupt
from .files import reserve_space, unlink
from .named_files import PREFIX, HostFile, named_files, remove_named
from .shm import map_named

__all__ = ["LOCAL_DIR_ENV", "LocalDiskCarrier", "local_dir"]

LOCAL_DIR_ENV = "DISTRIBUTE_UTILS_LOCAL_DIR"


def local_dir() -> str:
    """This user's private directory for local-disk payloads (not made: see :meth:`LocalDiskCarrier.publish`)."""
    base = os.environ.get(LOCAL_DIR_ENV) or tempfile.gettempdir()
    return os.path.join(os.path.abspath(base), f".distribute-utils-{os.geteuid()}")


class LocalDiskCarrier:
    """Moves payloads through files on this host's local disk (see the module doc); implements
    :class:`.base.Carrier` (kind ``"local_disk"``). Receipts: ``[directory, sender pid, nbytes]``."""

    kind = "local_disk"
    done_when_answered = False
    scope = "host"
    medium = "disk"
    max_bytes: int | None = None
    devices = "to_cpu"
    needs_go = False
    checksums = False
    settings: tuple[str, ...] = (LOCAL_DIR_ENV,)

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> LocalDiskCarrier:
        return cls()

    @property
    def label(self) -> str:
        return f"the local disk ({local_dir()})"

    @classmethod
    def sending(cls, destination: Destination) -> LocalDiskCarrier:
        """Only to a receiver that sees this process's local directory (:meth:`reaches`)."""
        if not (destination.pool and cls.reaches(destination.receiver)):
            raise TransportUnavailableError(
                "the local disk is not used: the receiving process does not see this one's directory"
            )
        return cls()

    @staticmethod
    def reaches(receiver: ProcessInfo | None) -> bool:
        """Whether ``receiver`` (a process of this host) sees this process's local directory: in this pid
        namespace, its root's view of the directory's parent is the very directory this process sees
        (containers may share ``/dev/shm`` and not ``/tmp``). False when that cannot be told."""
        if receiver is None:
            return False
        base = os.path.dirname(local_dir())
        try:
            theirs, mine = os.stat(f"/proc/{receiver.pid}/root{base}"), os.stat(base)
        except OSError:
            return False
        return (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino) and process_alive(receiver)

    def publish(self, token: str, rank: int, payload: EncodedPayload) -> list[Any]:
        """Write ``payload`` into a new file of the private local directory; returns the receipt.

        Raises:
            SpaceError: the directory's filesystem cannot hold the payload (nothing is left behind).
            PermissionError: the private directory is another user's (named).
        """
        directory = host_dir.private_dir(local_dir())
        path = os.path.join(directory, f"{PREFIX}{token}_{rank}_{os.getpid()}")
        removed_on_interrupt(LocalDiskCarrier)
        with interrupts.uninterruptible():  # an interrupt then sees the file and removes it
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                if not reserve_space(fd, payload.nbytes):
                    os.posix_fallocate(fd, 0, payload.nbytes)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                free = os.statvfs(directory)
                raise SpaceError(
                    errno.ENOSPC,
                    f"{directory} ({free.f_bavail * free.f_frsize:,} bytes free now) cannot hold the "
                    f"{payload.nbytes:,} bytes of rank {rank}'s payload either; set ${LOCAL_DIR_ENV} to a "
                    "local directory with room, enlarge /dev/shm or pass a workspace_path",
                ) from None
            payload.to_cpu().write_to_fd(fd)
        except BaseException:
            unlink(path)
            raise
        finally:
            os.close(fd)
        return [directory, os.getpid(), payload.nbytes]

    def fetch(self, token: str, rank: int, receipt: Any) -> Any:
        """``rank``'s payload, mapped copy-on-write from its file (unlinked at once). The directory
        and the file must be this user's and private, the file as long as the receipt says."""
        directory, pid, nbytes = _parse(receipt, rank)
        buf = map_named(self._path(directory, token, rank, pid), rank, nbytes)
        if stated_length(buf) != nbytes:
            raise PayloadError(
                f"the file of rank {rank} holds a payload of {stated_length(buf)} bytes, not {nbytes}"
            )
        return buf

    def discard(self, token: str, rank: int, receipt: Any) -> None:
        """The first rank, after a failure: remove ``rank``'s file if it is still there."""
        directory, pid, _ = _parse(receipt, rank)
        unlink(self._path(directory, token, rank, pid))

    def release(self, token: str, rank: int, receipt: Any = None, *, taken: bool = True) -> None:
        """The sender: remove its file of ``token`` if the first rank never took it."""
        unlink(os.path.join(local_dir(), f"{PREFIX}{token}_{rank}_{os.getpid()}"))

    @staticmethod
    def _path(directory: str, token: str, rank: int, pid: int) -> str:
        """The file a receipt names: only in a private local directory of this user (named as
        :func:`local_dir` names them, checked), never anywhere else a receipt could point."""
        try:
            if os.path.basename(directory) != os.path.basename(local_dir()):
                raise PermissionError(errno.EPERM, f"{directory} is not a local-disk carrier's directory")
            host_dir.check(directory)
        except OSError as exc:
            raise PayloadError(f"rank {rank} published its payload in an unusable directory: {exc}") from None
        return os.path.join(directory, f"{PREFIX}{token}_{rank}_{pid}")

    @staticmethod
    def remove_left_by(rank: int | None, pid: int) -> list[str]:
        """Remove the files a sender (``rank``, or any rank, of process ``pid``) left; the paths removed."""
        return remove_named(local_dir(), rank, pid)

    files_label = "payload file(s) on local disk"

    @staticmethod
    def files_on_host(shm_dir: str = "") -> list[HostFile]:
        """Every payload file in this user's local directory, with its owner's liveness (``shm_dir``:
        not read, the files are in :func:`local_dir`)."""
        return named_files(local_dir())


def _parse(receipt: Any, rank: int) -> tuple[str, int, int]:
    """``(directory, pid, nbytes)`` of a receipt, checked (it came from another process)."""
    if (
        type(receipt) is list
        and len(receipt) == 3
        and type(receipt[0]) is str
        and os.path.isabs(receipt[0])
        and type(receipt[1]) is int
        and type(receipt[2]) is int
    ):
        return receipt[0], receipt[1], receipt[2]
    raise PayloadError(f"rank {rank} sent a malformed local-disk receipt {receipt!r:.120}")
