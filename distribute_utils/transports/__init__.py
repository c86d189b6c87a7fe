"""Transports: shared memory on one host, files in a shared workspace, collectives.

``shm`` (one host), ``cuda_ipc`` (one host, CUDA tensors device to device), ``workspace`` (shared directory; built on ``files``, the file primitives, and
``namespace``, the job's directory with its owner records and sweep), ``collective`` (torch.distributed).
``nfs_workspace`` is ModelOpt's ``NFSWorkspace`` over the same directory.
"""

from __future__ import annotations

from .base import Transport
from .collective import CollectiveTransport
from .cuda_ipc import CudaIpcTransport
from .namespace import sweep_stale_namespaces
from .nfs_workspace import NFSWorkspace
from .shm import SharedMemoryTransport
from .workspace import WorkspaceTransport

__all__ = [
    "CollectiveTransport",
    "CudaIpcTransport",
    "NFSWorkspace",
    "SharedMemoryTransport",
    "Transport",
    "WorkspaceTransport",
    "sweep_stale_namespaces",
]
