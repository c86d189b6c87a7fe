"""Internal. Whether this host makes store connections quickly, for ``distribute-utils doctor``.

Every rank of a job connects to torch's ``TCPStore`` (the package opens a few more clients per rank: see
docs/reliability.md), and torch looks up the *name* of each connecting address (a reverse lookup, for
its messages). A server listening on every address sees a local peer as ``::ffff:127.0.0.1``, which
``/etc/hosts`` rarely lists, so the lookup goes to the DNS server; one that drops such a query makes the
connection wait the resolver's timeout (5 s by default): barriers and launches that take 5 s now and
then. :func:`check_store_connections` measures both: the lookups torch makes, and real connections.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from dataclasses import dataclass, field

__all__ = ["MAPPED_LOOPBACK", "SLOW_S", "StoreCheck", "check_store_connections", "hosts_file_names"]

#: How a local peer's address looks to a server listening on every address (IPv4-mapped IPv6).
MAPPED_LOOPBACK = "::ffff:127.0.0.1"
#: A lookup or connection slower than this is reported as a problem.
SLOW_S = 0.5


@dataclass
class StoreCheck:
    """What :func:`check_store_connections` found (seconds)."""

    in_hosts_file: bool  # /etc/hosts names MAPPED_LOOPBACK: no lookup leaves the host
    lookups: list[float] = field(default_factory=list)  # reverse lookups of MAPPED_LOOPBACK
    connects: list[float] = field(default_factory=list)  # new TCPStore clients of a local server

    @property
    def slowest(self) -> float:
        return max(self.lookups + self.connects, default=0.0)


def hosts_file_names(address: str, path: str = "/etc/hosts") -> bool:
    """Whether ``path`` has a line for ``address``."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return any(line.split("#", 1)[0].split()[:1] == [address] for line in f)
    except OSError:
        return False


def check_store_connections(lookups: int = 20, connects: int = 8) -> StoreCheck:
    """Times ``lookups`` reverse lookups of a local peer's address, as torch's store makes them, then
    ``connects`` new clients of a ``TCPStore`` on 127.0.0.1; stops at the first slow one of each (it
    costs seconds, and one is enough to know)."""
    import torch.distributed as dist

    found = StoreCheck(hosts_file_names(MAPPED_LOOPBACK))
    for _ in range(lookups):
        start = time.perf_counter()
        with contextlib.suppress(OSError):  # (no name: as slow as the resolver was)
            socket.getnameinfo((MAPPED_LOOPBACK, 0, 0, 0), 0)
        found.lookups.append(time.perf_counter() - start)
        if found.lookups[-1] > SLOW_S:
            break
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    try:
        for _ in range(connects):
            start = time.perf_counter()
            dist.TCPStore(
                "127.0.0.1", server.port, 1, is_master=False, timeout=datetime.timedelta(seconds=30)
            )
            found.connects.append(time.perf_counter() - start)
            if found.connects[-1] > SLOW_S:
                break
    finally:
        del server
    return found
