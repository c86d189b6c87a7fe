"""Internal. Carriers: how payload bytes travel from a sender to the first rank of a gather round.

One protocol (``base``: :class:`Carrier`, with the call order and how to add one) and one registry
(``carriers``: receipts tagged by kind, the receiving side's dispatch, the fault-injection point).
Carriers: ``inline`` (in the claim), ``shm`` (one host; segments, pooled, registered with CUDA by
``pinning``), ``cuda_ipc`` (one host, CUDA tensors device to device), ``workspace`` (shared directory;
built on ``files``, the file primitives, and ``namespace``, the job's directory with its owner records
and sweep), ``collective`` (torch.distributed). ``host`` is a sender's route within a host.
``nfs_workspace`` is ModelOpt's ``NFSWorkspace`` over the same directory.
"""

from __future__ import annotations

from .base import Carrier, Transport
from .collective import CollectiveTransport
from .cuda_ipc import CudaIpcTransport
from .namespace import sweep_stale_namespaces
from .nfs_workspace import NFSWorkspace
from .shm import SharedMemoryTransport
from .workspace import WorkspaceTransport

__all__ = [
    "Carrier",
    "CollectiveTransport",
    "CudaIpcTransport",
    "NFSWorkspace",
    "SharedMemoryTransport",
    "Transport",
    "WorkspaceTransport",
    "sweep_stale_namespaces",
]
