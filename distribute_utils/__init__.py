"""distribute_utils: gather configs and tensor shards to one rank at the end of a distributed job."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .consolidate import consolidate_checkpoint
    from .errors import (
        DeviceUnavailableError,
        DistributeError,
        ForkedProcessError,
        GatherError,
        PayloadError,
        PeerLostError,
        SpaceError,
        TransportUnavailableError,
        WorkspaceError,
    )
    from .gather import gather_configs, gather_tensors, get_configs_parallel, get_tensors_parallel
    from .mesh import ProcessGroupMesh
    from .mesh_layout import MeshLayout
    from .sync import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, barrier
    from .transports import NFSWorkspace
    from .transports.shm import release_shared_memory

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "DeviceUnavailableError",
    "DistributeError",
    "ForkedProcessError",
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

# Where each public name lives; imported on first use (PEP 562), so that ``distribute-utils --version``
# and ``--help`` do not import torch.
_HOMES = {
    "consolidate_checkpoint": ".consolidate",
    "DeviceUnavailableError": ".errors",
    "DistributeError": ".errors",
    "ForkedProcessError": ".errors",
    "GatherError": ".errors",
    "PayloadError": ".errors",
    "PeerLostError": ".errors",
    "SpaceError": ".errors",
    "TransportUnavailableError": ".errors",
    "WorkspaceError": ".errors",
    "gather_configs": ".gather",
    "gather_tensors": ".gather",
    "get_configs_parallel": ".gather",
    "get_tensors_parallel": ".gather",
    "MeshLayout": ".mesh_layout",
    "ProcessGroupMesh": ".mesh",
    "DEFAULT_TIMEOUT_S": ".sync",
    "TIMEOUT_ENV": ".sync",
    "barrier": ".sync",
    "NFSWorkspace": ".transports",
    "release_shared_memory": ".transports.shm",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'distribute_utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
