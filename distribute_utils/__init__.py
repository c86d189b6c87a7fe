"""distribute_utils: gather configs and tensor shards to one rank at the end of a distributed job."""

from __future__ import annotations

from .consolidate import consolidate_checkpoint
from .errors import (
    DistributeError,
    GatherError,
    PayloadError,
    PeerLostError,
    SpaceError,
    TransportUnavailableError,
    WorkspaceError,
)
from .gather import gather_configs, gather_tensors, get_configs_parallel, get_tensors_parallel
from .layout import MeshLayout
from .mesh import ProcessGroupMesh
from .sync import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, barrier
from .transports import NFSWorkspace
from .transports.shm import release_shared_memory

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "DistributeError",
    "GatherError",
    "MeshLayout",
    "NFSWorkspace",
    "PayloadError",
    "PeerLostError",
    "ProcessGroupMesh",
    "SpaceError",
    "TransportUnavailableError",
    "WorkspaceError",
    "__version__",
    "barrier",
    "consolidate_checkpoint",
    "gather_configs",
    "gather_tensors",
    "get_configs_parallel",
    "get_tensors_parallel",
    "release_shared_memory",
]
