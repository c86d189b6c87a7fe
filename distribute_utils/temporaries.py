"""Internal. Temporary files a process must remove unless it finishes, and a record of them for ``clean``.

Output files are written under temporary names and renamed into place once complete. A
:class:`Temporaries` is made *before* its files exist: it registers an undo with :mod:`.interrupts`
(so an interrupted process removes them) and writes a record ``<RECORD_DIR>/<pid>-<token>.json`` naming
them and their owner (a killed process cannot clean up: ``distribute-utils clean`` reads the records of
dead owners with :func:`find_abandoned` and removes what they list with :func:`remove_abandoned`).

Call order: ``Temporaries(finals)``, then :meth:`~Temporaries.create` each file (or write it by path
after ``create``), then either :meth:`~Temporaries.publish` (rename into place, in one uninterruptible
section) or :meth:`~Temporaries.remove`. :func:`write_atomically` does all of it for one file: the one
write-temporary / ``fsync`` / rename of the package (output files, layouts written for tests and
benchmarks, and, unrecorded, the workspace's payload files). The record lives in ``/dev/shm`` (per host, as pids are), in a
directory private to the user (mode 0700, checked); where it cannot be made, nothing is recorded and
only the interrupt undo remains. ``clean`` removes a listed file only if it is still a regular file of
this user whose name carries the dead owner's pid (``.<final>.tmp-<pid>-<hex>``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import host_dir, interrupts
from .errors import ArgumentError
from .processes import ProcessInfo, process_alive, this_process

__all__ = [
    "RECORD_DIR",
    "Abandoned",
    "Temporaries",
    "find_abandoned",
    "remove_abandoned",
    "remove_abandoned_by",
    "remove_file",
    "write_atomically",
]

logger = logging.getLogger(__name__)

#: Where the records are kept, as ``*.json`` (this user's private directory on this host, :mod:`.host_dir`).
RECORD_DIR = host_dir.PRIVATE_DIR


def _temp_pattern(pid: int) -> re.Pattern[str]:
    return re.compile(rf"\..+\.tmp-{int(pid)}-[0-9a-f]+")


def _private_dir() -> str | None:
    """The record directory, made if needed; ``None`` if it is not this user's private directory."""
    try:
        return host_dir.private_dir(RECORD_DIR)
    except PermissionError as exc:
        logger.warning("not recording temporary files: %s", exc)
    except OSError:
        pass
    return None


class Temporaries:
    """Temporary files for ``finals`` (one each, same directory): see the module docstring.

    Attributes:
        temps: the temporary paths, in the order of ``finals``.
        finals: the final paths.
    """

    def __init__(self, finals: Sequence[str | os.PathLike[str]]) -> None:
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.finals = [Path(f) for f in finals]
        self.temps = [f.parent / f".{f.name}.tmp-{token}" for f in self.finals]
        self._record: str | None = None
        self._undo: interrupts.Undo | None = None
        with interrupts.uninterruptible():
            self._undo = interrupts.on_interrupt(self.remove)
            self._record = self._write_record(token)

    def _write_record(self, token: str) -> str | None:
        body = {"owner": this_process().to_wire(), "paths": [os.path.abspath(t) for t in self.temps]}
        for _attempt in range(2):  # another process may remove the empty directory in between
            directory = _private_dir()
            if directory is None:
                return None
            path = os.path.join(directory, f"{token}.json")
            try:
                with open(path, "x", encoding="utf-8") as f:
                    json.dump(body, f)
                return path
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("could not record temporary files in %s: %s", directory, exc)
                return None
        return None

    def create(self, temp: str | os.PathLike[str], mode: int = 0o666) -> int:
        """Creates one of :attr:`temps` exclusively and returns its descriptor (write only, close on exec)."""
        if Path(temp) not in self.temps:
            raise ArgumentError(
                f"'{temp}' is not one of these temporaries; valid: {', '.join(sorted(map(str, self.temps)))}"
            )
        with interrupts.uninterruptible():
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)

    def publish(self) -> None:
        """Renames every temporary over its final name (in order) and syncs the directories; the files are
        then no longer temporaries. An interrupt waits for this to finish."""
        with interrupts.uninterruptible():
            for temp, final in zip(self.temps, self.finals):
                os.replace(temp, final)
            for directory in {f.parent for f in self.finals}:
                _fsync_dir(directory)
            self._forget()

    def remove(self) -> None:
        """Removes the temporaries that exist and forgets them. Safe to call more than once."""
        for temp in self.temps:
            remove_file(temp)
        self._forget()

    def _forget(self) -> None:
        if self._undo is not None:
            self._undo.cancel()
            self._undo = None
        if self._record is not None:
            _remove_record(self._record)
            self._record = None


def write_atomically(
    final: str | os.PathLike[str],
    write: Callable[[int], None],
    *,
    mode: int = 0o666,
    fsync: bool = True,
    record: bool = True,
    temps: set[str] | None = None,
    remove: Callable[[str], bool] | None = None,
) -> Path:
    """Writes the file ``final`` whole or not at all; any process may call it.

    ``write(fd)`` fills a new temporary beside ``final`` (``.<name>.tmp-<pid>-<hex>``, created with
    ``O_EXCL``), which is ``fsync``ed (unless ``fsync`` is false), closed and renamed over ``final``; on any
    error, the temporary is removed and the error raised. With ``record`` (the default) the temporary is
    one of :class:`Temporaries`: removed on an interrupt, listed for ``distribute-utils clean`` after a
    kill, and the directory is synced after the rename. Without, nothing outlives an error but the
    caller's ``temps``: a set that holds the temporary's path while it exists (a transport removes what is
    left there when it releases a payload); ``remove(path)`` removes it after an error (True once it is
    gone; default: unlink, logging a failure).

    Returns:
        ``final`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: from creating, writing, syncing or renaming (the temporary is gone, except where it could
            not be removed: then it stays in ``temps``).
    """
    path = Path(final)
    held = Temporaries([path]) if record else None
    if held is not None:
        temp = held.temps[0]
    else:
        temp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        if held is not None:
            fd = held.create(temp, mode)
        else:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except BaseException:
        if held is not None:
            held.remove()
        raise
    if temps is not None:
        temps.add(str(temp))
    try:
        try:
            write(fd)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)  # NFS reports deferred write errors (ENOSPC, EDQUOT) here too
        if held is not None:
            held.publish()
        else:
            os.rename(temp, path)
    except BaseException:
        if held is not None:
            held.remove()
        elif (remove or remove_file)(str(temp)) and temps is not None:
            temps.discard(str(temp))  # else the caller tries again
        raise
    if temps is not None:
        temps.discard(str(temp))
    return path


def remove_file(path: str | os.PathLike[str]) -> bool:
    """Removes ``path``; True once it is gone (a failure is logged, never raised)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove temporary file %s: %s", path, exc)
        return False
    return True


def _remove_record(record: str) -> None:
    """Removes a record, and the record directory once it is empty (nothing is left in /dev/shm)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record)
    with contextlib.suppress(OSError):  # not empty: other processes' records
        os.rmdir(os.path.dirname(record))


def _fsync_dir(path: Path) -> None:
    """Makes renames in ``path`` durable (where the filesystem supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # pragma: no cover - platforms without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Abandoned:
    """The record of a process that died holding temporaries.

    Attributes:
        record: the record file.
        owner: the process that made it (dead).
        paths: its temporaries that still exist and may be removed (see the module docstring).
        nbytes: their total size.
    """

    record: str
    owner: ProcessInfo
    paths: tuple[str, ...]
    nbytes: int


def find_abandoned(record_dir: str = RECORD_DIR) -> list[Abandoned]:
    """Records of dead owners in ``record_dir`` (owners in another pid namespace or boot are left alone)."""
    here = this_process()
    found = []
    with contextlib.suppress(OSError):
        names = sorted(os.listdir(record_dir))
        for name in names:
            if not name.endswith(".json"):
                continue  # (sockets: see host_dir)
            path = os.path.join(record_dir, name)
            try:
                with open(path, encoding="utf-8") as f:
                    body = json.load(f)
                owner = ProcessInfo.from_wire(body["owner"])
                listed = [str(p) for p in body["paths"]]
            except (OSError, ValueError, KeyError, TypeError):
                logger.debug("unreadable temporaries record %s", path, exc_info=True)
                continue
            if not here.can_watch(owner) or process_alive(owner):
                continue
            paths, nbytes = _removable(listed, owner.pid)
            found.append(Abandoned(path, owner, tuple(paths), nbytes))
    return found


def _removable(listed: Sequence[str], pid: int) -> tuple[list[str], int]:
    pattern = _temp_pattern(pid)
    paths, nbytes = [], 0
    for p in listed:
        if not pattern.fullmatch(os.path.basename(p)):
            continue
        try:
            info = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            paths.append(p)
            nbytes += info.st_size
    return paths, nbytes


def remove_abandoned(item: Abandoned) -> list[str]:
    """Removes an abandoned record's temporaries, then the record; returns the paths removed."""
    removed = []
    for p in item.paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            removed.append(p)
    _remove_record(item.record)
    return removed


def remove_abandoned_by(pid: int, record_dir: str = RECORD_DIR) -> list[str]:
    """Removes what process ``pid`` (dead, of this host) left: used by a launcher after killing a rank."""
    removed: list[str] = []
    for item in find_abandoned(record_dir):
        if item.owner.pid == pid:
            removed += remove_abandoned(item)
    return removed
