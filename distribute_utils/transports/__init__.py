"""Transports: shared memory on one host, files in a shared workspace, collectives."""

from __future__ import annotations

from .base import Transport
from .collective import CollectiveTransport
from .shm import SharedMemoryTransport
from .workspace import NFSWorkspace, WorkspaceTransport, sweep_stale_namespaces

__all__ = [
    "CollectiveTransport",
    "NFSWorkspace",
    "SharedMemoryTransport",
    "Transport",
    "WorkspaceTransport",
    "sweep_stale_namespaces",
]
