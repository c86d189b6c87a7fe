"""Internal. The files a carrier names after their sender on this host (``du_<token>_<rank>_<pid>``: named
shared-memory segments, local-disk payloads): listed with their owner's liveness for ``doctor`` and
``clean`` (a carrier's ``files_on_host``, see :class:`.base.Carrier`), and a dead sender's removed
(its ``remove_left_by``). Only regular files are looked at; only this user's are removed."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import dataclass

from ..processes import pid_alive

__all__ = ["PREFIX", "HostFile", "named_files", "remove_named"]

PREFIX = "du_"
_NAME_RE = re.compile(r"du_(?P<token>[0-9a-f]+)_(?P<rank>\d+)_(?P<pid>\d+)")


@dataclass(frozen=True)
class HostFile:
    """One ``du_*`` file a carrier may have named.

    Attributes:
        name: file name, ``du_<token>_<rank>_<pid>`` when it is one of ours.
        path: full path.
        size: bytes it holds.
        uid: owner user id.
        pid: the owner process from the name, None when the name is not one of ours.
        alive: whether that process runs in this pid namespace (None when ``pid`` is None).
    """

    name: str
    path: str
    size: int
    uid: int
    pid: int | None
    alive: bool | None

    @property
    def stale(self) -> bool:
        """Its owner has exited: ``clean`` removes it."""
        return self.alive is False


def named_files(directory: str) -> list[HostFile]:
    """Every regular ``du_*`` file of ``directory``, sorted by name (empty when it cannot be listed)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        m = _NAME_RE.fullmatch(name)
        pid = int(m["pid"]) if m else None
        found.append(
            HostFile(name, path, st.st_size, st.st_uid, pid, None if pid is None else pid_alive(pid))
        )
    return found


def remove_named(directory: str, rank: int | None, pid: int) -> list[str]:
    """Remove the files of ``directory`` that sender ``rank`` (any rank: None) of process ``pid`` named:
    only regular files of this user whose name says so. Returns the paths removed."""
    suffix = f"_{int(pid)}" if rank is None else f"_{int(rank)}_{int(pid)}"
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(PREFIX) and name.endswith(suffix):
                path = os.path.join(directory, name)
                with contextlib.suppress(OSError):
                    info = os.lstat(path)
                    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                        os.unlink(path)
                        removed.append(path)
    return removed
