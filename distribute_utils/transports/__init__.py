"""Transports: shared memory on one host, files in a shared workspace, collectives."""

from __future__ import annotations

from .base import Transport
from .collective import CollectiveTransport
from .shm import SharedMemoryTransport

__all__ = ["CollectiveTransport", "SharedMemoryTransport", "Transport"]
