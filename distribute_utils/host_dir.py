"""Internal. This user's private directory on this host: ``/dev/shm/.distribute-utils-<uid>`` (mode 0700, checked).

It holds what other local users must never reach: the records of temporary files
(:mod:`distribute_utils.temporaries`) and the Unix sockets that processes of one host send each other
claims, verdicts and notices through (:mod:`distribute_utils.mailbox`, the segment pool's notices).
A socket here can be bound, read or sent to only by this user (and root): the directory lets nobody
else in, where an abstract socket name would carry no permissions at all. Its name is predictable, so
another user may make it first: then :func:`private_dir` refuses it (``PermissionError``), naming its owner, and what needs
it goes without (temporaries are not recorded; the process gathers through the job's store).

Sockets are named ``*.sock``. A socket whose process died stays as a file (no memory, one inode) until
:func:`remove_dead_sockets` (``distribute-utils clean``; every process once when it starts listening)
finds that nothing listens on it any more. The directory is removed when it is found empty.

Call order: :func:`bind` a socket (it makes and checks the directory), :func:`unbind` it when done;
senders name a peer's socket with :func:`socket_path` and send through :class:`Connections` (a socket
kept connected per peer: a send by path costs the kernel a lookup of the path every time) or
:func:`send_by`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from collections.abc import Sequence
from typing import Any

from .processes import SHM_DIR

__all__ = [
    "PRIVATE_DIR",
    "SOCKET_SUFFIX",
    "Connections",
    "bind",
    "check",
    "dead_sockets",
    "not_private",
    "private_dir",
    "remove_dead_sockets",
    "send_by",
    "socket_path",
    "timeval",
    "unbind",
]

logger = logging.getLogger(__name__)

#: This user's private directory on this host (per host, as pids and ``/dev/shm`` are).
PRIVATE_DIR = os.path.join(SHM_DIR, f".distribute-utils-{os.geteuid()}")
SOCKET_SUFFIX = ".sock"


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return "unknown user"


def private_dir(directory: str = PRIVATE_DIR) -> str:
    """``directory``, made (0700) if needed, once checked to be a real directory of this user that no
    other user can enter.

    Raises:
        PermissionError: naming the directory, what is wrong (another user made it, it is a link, it is
            open to others) and how to fix it.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    check(directory)
    return directory


def check(directory: str = PRIVATE_DIR) -> None:
    """Refuse ``directory`` unless it is a real directory of this user that no other user can enter
    (as :func:`private_dir`, making nothing).

    Raises:
        PermissionError: as :func:`private_dir`.
        FileNotFoundError: it does not exist.
    """
    problem = not_private(directory, (os.geteuid(),))
    if problem is not None:
        raise PermissionError(
            errno.EPERM,
            f"{directory} {problem}: another user could reach what this process keeps there, so it is not "
            "used; remove it (as its owner or root)",
        )


def not_private(directory: str, owners: tuple[int, ...]) -> str | None:
    """What makes ``directory`` unfit to keep a job's files ("is a symbolic link (to ...)", "belongs to
    uid ...", "has mode ..."), or None when it is a real directory of one of ``owners``'s uids (the first:
    this user's) with no group or other permission bits."""
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        return f"is a symbolic link (to {os.readlink(directory)!r})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in owners:
        return (
            f"belongs to uid {info.st_uid} ({_owner_name(info.st_uid)}), not to this user (uid {owners[0]})"
        )
    if info.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(info.st_mode):o}, not 700"
    return None


def socket_path(name: str, directory: str = PRIVATE_DIR) -> str:
    """The path of socket ``name`` (letters, digits, ``-``; at most 64) in this user's private directory."""
    return os.path.join(directory, name + SOCKET_SUFFIX)


def _listening(path: str) -> bool:
    """Whether a socket is bound at ``path`` (a datagram connect is refused where none is)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)
        return True
    except ConnectionRefusedError:
        return False
    except OSError:  # not a socket, gone, or not ours to reach: leave it
        return True
    finally:
        probe.close()


def bind(sock: socket.socket, name: str, directory: str = PRIVATE_DIR) -> str:
    """Bind ``sock`` (``AF_UNIX``) to :func:`socket_path` ``name``, making and checking the directory.
    A socket file left there by a process that died is replaced; a live one is not.

    Returns:
        The path bound.

    Raises:
        PermissionError: the directory is another user's or open to others.
        OSError: the address is in use by a live socket, or the kernel refused.
    """
    path = socket_path(name, directory)
    for attempt in range(3):
        private_dir(directory)
        try:
            sock.bind(path)
        except FileNotFoundError:  # another process removed the directory when it was empty: make it again
            continue
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == 2 or _listening(path):
                raise
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead process's socket (nothing listens there)
            continue
        # Checked again now that the socket exists: between the check and the bind another user could have
        # put a link or a directory of theirs at the name (after this process's own removed it, empty).
        check(directory)
        return path
    raise FileNotFoundError(errno.ENOENT, f"{directory} keeps disappearing", path)


def unbind(path: str) -> None:
    """Remove the socket file at ``path`` (after its socket is closed), then the directory if empty."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with contextlib.suppress(OSError):  # not empty: other processes' sockets or records
        os.rmdir(os.path.dirname(path))


def dead_sockets(directory: str = PRIVATE_DIR) -> list[str]:
    """Socket files in ``directory`` that nothing listens on any more (their processes died)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        if not name.endswith(SOCKET_SUFFIX):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode) and not _listening(path):
                found.append(path)
    return found


def remove_dead_sockets(directory: str = PRIVATE_DIR) -> list[str]:
    """Remove :func:`dead_sockets` (never a live one), then the directory if that left it empty (as
    :func:`unbind` does); returns the paths removed."""
    removed = []
    for path in dead_sockets(directory):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    if removed:
        with contextlib.suppress(OSError):  # not empty: live sockets, records
            os.rmdir(directory)
    return removed


_NO_WAIT = int(socket.MSG_DONTWAIT)


def timeval(seconds: float) -> bytes:
    """``seconds`` (at least 1 µs) as the ``struct timeval`` of ``SO_SNDTIMEO`` / ``SO_RCVTIMEO``."""
    whole, micros = divmod(max(1, int(seconds * 1e6)), 1_000_000)
    return struct.pack("ll", whole, micros)


def send_by(
    sock: socket.socket, parts: Sequence[Any], to: tuple[str, ...] = (), timeout: float = 0.0
) -> bool | None:
    """One datagram of ``parts`` through ``sock``, to the socket at path ``to[0]`` (none: ``sock``'s
    connected peer). True when sent; False when the peer's queue stays full past ``timeout`` (0: at
    once); None when nobody listens there (no socket file, or its socket closed)."""
    try:
        sock.sendmsg(parts, (), _NO_WAIT, *to)
        return True
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except BlockingIOError:  # the peer's queue is full: wait for room (rare)
        if timeout <= 0:
            return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(timeout))
    try:
        sock.sendmsg(parts, (), 0, *to)
        return True
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except BlockingIOError:
        return False


class Connections:
    """Datagram sockets kept connected to the sockets at some paths, one per path, for sending: a send
    through one skips the kernel's lookup of the path (and its permission checks) that a send by path
    costs every time. At most ``kept`` (the oldest is closed past it); a peer that closed its socket is
    connected anew at the next send (a socket bound at its path since gets it). Its owner's thread only;
    :meth:`close` ends them all (a forked child closes its copies)."""

    def __init__(self, kept: int = 64, send_buffer: int = 0) -> None:
        self._kept, self._send_buffer = kept, send_buffer
        self._socks: dict[str, socket.socket] = {}

    def send(self, path: str, parts: Sequence[Any], timeout: float = 0.0) -> bool:
        """One datagram to the socket at ``path``: False when nobody listens there, or its queue stays
        full past ``timeout`` (see :func:`send_by`)."""
        sock = self._socks.get(path)
        if sock is not None:
            sent = send_by(sock, parts, (), timeout)
            if sent is not None:
                return sent
            self.forget(path)  # (its peer closed: a socket bound there since is connected anew)
        try:
            sock = self._connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        sent = send_by(sock, parts, (), timeout)
        if sent is None:
            self.forget(path)
        return bool(sent)

    def kept(self, path: str) -> socket.socket | None:
        """The socket kept connected to ``path``, if any, for a caller that sends through it itself and
        handles what :meth:`send_now` handles (:class:`~distribute_utils.mailbox.Line`); a socket forgotten
        since is closed, so a send through it fails."""
        return self._socks.get(path)

    def send_now(self, path: str, parts: Sequence[Any]) -> bool:
        """One datagram to the socket at ``path`` through the socket kept connected to it, at once: False
        when none is kept or it cannot go now (nothing was sent: :meth:`send` then does what it does)."""
        sock = self._socks.get(path)
        if sock is None:
            return False
        try:
            sock.sendmsg(parts, (), _NO_WAIT)
        except (FileNotFoundError, ConnectionRefusedError):
            self.forget(path)  # (its peer closed, and the kernel disconnected it: send() connects anew)
            return False
        except OSError:
            return False
        return True

    def _connect(self, path: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            if self._send_buffer:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        if len(self._socks) >= self._kept:
            self.forget(next(iter(self._socks)))
        self._socks[path] = sock
        return sock

    def forget(self, path: str) -> None:
        """Close the socket kept for ``path``, if any."""
        sock = self._socks.pop(path, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close every socket kept."""
        for path in list(self._socks):
            self.forget(path)
