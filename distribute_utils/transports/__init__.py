"""Transports: shared memory on one host, files in a shared workspace, collectives."""

from __future__ import annotations

from .base import Transport
from .shm import SharedMemoryTransport

__all__ = ["SharedMemoryTransport", "Transport"]
