"""Internal. Who sends to whom in one gather: the first rank works the plan out and tells remote senders.

:func:`make_plan` chooses the route of every payload from where the ranks run (their shared-memory
domains) and the transport asked for; :class:`Plan` is what it chooses, packed for the senders that
need it (those on another host than the first rank).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import msgpack

from ..errors import TransportUnavailableError
from ..transports.router import Request, across

__all__ = ["Plan", "make_plan"]


@dataclass(frozen=True)
class Plan:
    """Who sends to whom in one gather; the first rank works it out and tells remote senders.

    Participants on the first rank's host send to it through shared memory (or inside their
    claim, when small). On every other host, the first participant leads: its host's other
    participants send to it, and it forwards one bundle for the whole host over the
    cross-host transport. Forced ``workspace`` / ``collective`` transports make every sender
    its own leader (flat: no shared-memory hop).
    """

    ranks: tuple[int, ...]
    cross: str | None  # the kind of the carrier across hosts (router.cross_carrier), None: one host
    hosts: dict[int, list[int]]  # leader -> participants on its host, leader first

    @property
    def first(self) -> int:
        return self.ranks[0]

    @functools.cached_property
    def remote(self) -> bool:
        """Some participant is on another host (it needs this plan to know its route)."""
        return (
            len(self.hosts) > 1 and self.cross is not None and len(self.hosts[self.first]) < len(self.ranks)
        )

    def leader_of(self, rank: int) -> int:
        return next(leader for leader, host in self.hosts.items() if rank in host)

    @functools.cached_property
    def direct(self) -> list[int]:
        """Who sends straight to the first rank: its own host's senders and every remote host's
        leader, in ``ranks`` order."""
        senders = {r for r in self.hosts if r != self.first} | set(self.hosts[self.first][1:])
        return [r for r in self.ranks if r in senders]

    @functools.cached_property
    def description(self) -> str:
        """The route in words, for messages ("shm", "workspace", ...)."""
        if self.cross is None:
            return "shm"
        remote = [h for leader, h in self.hosts.items() if leader != self.first]
        if all(len(h) == 1 for h in remote) and len(self.hosts[self.first]) == 1:
            return self.cross
        return f"shm within hosts + {self.cross} across {len(remote)} remote host(s)"

    def pack(self) -> bytes:
        return msgpack.packb([list(self.ranks), self.cross, [[k, v] for k, v in self.hosts.items()]])

    @classmethod
    def unpack(cls, data: bytes) -> Plan:
        ranks, cross, hosts = msgpack.unpackb(data)
        return cls(tuple(ranks), cross, {k: v for k, v in hosts})


def make_plan(asked: Request, ranks: list[int], domains: dict[int, str], has_workspace: bool) -> Plan:
    """Choose the route of every payload (raises before the first rank reads anything): with a forced
    carrier every sender is its own leader (``domains`` unread); else the ranks of each shared-memory
    domain (host) send to its first, which forwards one bundle across (:func:`.router.across`)."""
    first, order = ranks[0], tuple(ranks)
    if asked.flat:
        return Plan(order, across(asked, has_workspace).kind, {r: [r] for r in ranks})
    by_domain: dict[str, list[int]] = {}
    for r in ranks:
        by_domain.setdefault(domains[r], []).append(r)
    if len(by_domain) == 1:
        return Plan(order, None, {first: list(ranks)})
    if asked.host_only:
        raise TransportUnavailableError(
            f"transport='shm' needs every participant on one host with one /dev/shm, but ranks {ranks} "
            f"span {len(by_domain)} shared-memory domains; use transport='auto'"
        )
    return Plan(order, across(asked, has_workspace).kind, {h[0]: h for h in by_domain.values()})
