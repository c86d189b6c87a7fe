"""Files created in watched directories, whichever process creates them (inotify(7) through ctypes: the standard library has no binding)."""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from collections.abc import Sequence

_IN_CLOSE_WRITE = 0x8
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_Q_OVERFLOW = 0x4000
_IN_ISDIR = 0x40000000
_INOTIFY_EVENT = struct.Struct("iIII")
WS_MARK_PREFIX = ".mark-"
"""Names of the marker files the parent and the ranks use to delimit rounds (not counted as payload files)."""


class FileEvents:
    """Records the files created and renamed in some directories, with inotify(7), in a thread.

    The kernel reports every creation in a watched directory whichever process makes it: a
    rank on a simulated node (its own mount namespace), or the sftp server behind every sshfs
    mount. Nothing is asked of the library. Directories are not watched recursively, so the
    benchmark creates the job's namespace directory (its job token is fixed through
    ``$DISTRIBUTE_UTILS_JOB_TOKEN``) and the baseline directory before the ranks start.
    """

    def __init__(self, directories: Sequence[str | os.PathLike[str]]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._dirs: dict[int, str] = {}
        try:
            for directory in directories:
                path = os.fspath(directory)
                wd = libc.inotify_add_watch(
                    self._fd, os.fsencode(path), _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE
                )
                if wd < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
                self._dirs[wd] = path
        except BaseException:
            os.close(self._fd)
            raise
        self.events: list[tuple[str, str, int]] = []  # (directory, name, mask), in kernel order
        self.overflowed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="FileEvents", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            pos = 0
            while pos < len(data):
                wd, mask, _cookie, length = _INOTIFY_EVENT.unpack_from(data, pos)
                start = pos + _INOTIFY_EVENT.size
                name = data[start : start + length].split(b"\0", 1)[0].decode(errors="replace")
                pos = start + length
                if mask & _IN_Q_OVERFLOW:
                    self.overflowed = True
                elif wd in self._dirs:
                    self.events.append((self._dirs[wd], name, mask))

    def _run(self) -> None:
        while not self._stop.is_set():
            select.select([self._fd], [], [], 0.1)
            self._drain()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._stop.set()
        self._thread.join()
        self._drain()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> FileEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def count(self, marks_dir: str, marks: dict[str, str | None]) -> dict[str, dict[str, int]]:
        """Per ``case|key``: files created, renamed into place and closed after writing.

        Events between a method's start marker and the next marker belong to that method.
        """
        counts: dict[str, dict[str, int]] = {}
        current: str | None = None
        for directory, name, mask in self.events:
            if directory == marks_dir and name.startswith(WS_MARK_PREFIX):
                if mask & _IN_CREATE:
                    current = marks.get(name)
                continue
            if current is None or mask & _IN_ISDIR:
                continue
            entry = counts.setdefault(
                current, {"created": 0, "renamed_into_place": 0, "closed_after_write": 0}
            )
            if mask & _IN_CREATE:
                entry["created"] += 1
            if mask & _IN_MOVED_TO:
                entry["renamed_into_place"] += 1
            if mask & _IN_CLOSE_WRITE:
                entry["closed_after_write"] += 1
        return counts
