"""Internal. Facts about this process and its host: identity, shared-memory domain, liveness of peers.

Two processes can share POSIX shared memory when they run on the same kernel (boot id) and
see the same ``/dev/shm`` mount (its device number); the hostname alone is not enough
(containers and simulated nodes share hostnames or boot ids). They can check each other's
liveness by pid when they also share a pid namespace, and reach each other's abstract Unix
sockets (:mod:`distribute_utils.mailbox`) when they also share a network namespace.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SHM_DIR", "ProcessInfo", "pid_alive", "pid_start_time", "process_alive", "this_process"]

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class ProcessInfo:
    """Where a rank runs: enough to tell shared-memory peers and to check liveness."""

    hostname: str
    boot_id: str
    shm_device: int
    pid_namespace: int
    pid: int
    start_time: int
    net_namespace: int = -1  # -1: unknown

    @property
    def shm_domain(self) -> str:
        """Equal for processes that see the same ``/dev/shm``."""
        return f"{self.boot_id}:{self.shm_device}"

    def can_watch(self, other: ProcessInfo) -> bool:
        """Whether this process can tell by pid if ``other`` is alive."""
        return (self.boot_id, self.pid_namespace) == (other.boot_id, other.pid_namespace)

    @property
    def direct_domain(self) -> tuple[str, int, int, int] | None:
        """Equal for processes that share memory, see each other's pids and can send each other
        datagrams with the kernel naming the sender; None when unknown."""
        if self.net_namespace == -1 or self.pid_namespace == -1:
            return None
        return (self.boot_id, self.shm_device, self.pid_namespace, self.net_namespace)

    def to_wire(self) -> list[object]:
        return [
            self.hostname,
            self.boot_id,
            self.shm_device,
            self.pid_namespace,
            self.pid,
            self.start_time,
            self.net_namespace,
        ]

    @classmethod
    def from_wire(cls, items: Sequence[Any]) -> ProcessInfo:
        """Read :meth:`to_wire`'s list (also one of 6 items, written before the network namespace was)."""
        hostname, boot_id, shm_device, pid_ns, pid, start, *rest = items
        net_ns = int(rest[0]) if rest else -1
        return cls(str(hostname), str(boot_id), int(shm_device), int(pid_ns), int(pid), int(start), net_ns)


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state first, start time at index 19), or None if no such pid.

    The command name (field 2) may hold spaces and parentheses, so the split is after its last ')'.
    """
    stat = _read(f"/proc/{pid}/stat") if pid > 0 else ""
    return stat.rsplit(")", 1)[-1].split() if stat else None


def pid_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot, or -1 when it does not exist (with the pid, what
    tells a process from a later one that reuses its pid: :class:`ProcessInfo`, records ``clean`` reads)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else -1


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs in this pid namespace (a zombie counts as dead); prefer :func:`process_alive`,
    which also tells a reused pid."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def _shm_device() -> int:
    try:
        return os.stat(SHM_DIR).st_dev
    except OSError:
        return -1


def _namespace(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return -1


def this_process() -> ProcessInfo:
    """Facts about the calling process (read afresh each call: a process may move to other namespaces)."""
    hostname = socket.gethostname()
    boot_id = _read("/proc/sys/kernel/random/boot_id", default=f"no-boot-id:{hostname}")
    pid = os.getpid()
    return ProcessInfo(
        hostname, boot_id, _shm_device(), _namespace("pid"), pid, pid_start_time(pid), _namespace("net")
    )


def process_alive(info: ProcessInfo) -> bool:
    """Whether the process ``info`` describes still runs (same pid *and* start time).

    Only meaningful when ``this_process().can_watch(info)``; a zombie counts as dead.
    """
    fields = _proc_stat(info.pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == info.start_time
