"""``ProcessGroupMesh``: creates and caches the process groups of an N-dimensional mesh.

A drop-in superset of ColossalAI's class of the same name. It only organises groups; the
mesh-aware gathers live in :mod:`distribute_utils.gather` and take a mesh.

Creation order: ``torch.distributed.new_group`` must be called by every rank of the world,
in the same order. ``create_group_along_axis`` therefore walks *every* group along the axis,
in ascending order of first rank, on every rank; so every rank of the world must call it (and
``get_group_along_axis`` when the group is not cached yet) with the same arguments in the same
order, members of the mesh or not. Barriers need no group: they run on the CPU companion of
the ranks (see :mod:`distribute_utils.sync`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import msgpack
import torch
import torch.distributed as dist

from . import sync
from .errors import ArgumentError, plural_list
from .mesh_layout import AxisSpec, MeshLayout, RavelMode

__all__ = ["ProcessGroupMesh"]

logger = logging.getLogger(__name__)

IndicesAtAxis = Sequence[int] | Sequence[Sequence[int]] | None


class ProcessGroupMesh:
    """An N-dimensional mesh of the ranks of the current job, and its cached groups.

    Must be constructed on every rank of the world (it checks that all ranks agree on the
    layout, so a mismatch raises ``ValueError`` everywhere instead of hanging later).

    Args:
        *size: size of each axis; their product plus ``rank_offset`` must not exceed the
            world size (the mesh may cover only part of the world).
        axis_names: optional unique name per axis, usable wherever an axis is taken.
        rank_offset: global rank of coordinate ``(0, ..., 0)``.
        backend: default backend of the groups it creates (None: the world's default).
        timeout: bound on the layout agreement check (seconds or timedelta).

    Attributes:
        shape: size of each axis.
        rank: this process's global rank.
        layout: the pure :class:`MeshLayout`.
    """

    def __init__(
        self,
        *size: int | Sequence[int],
        axis_names: Sequence[str] | None = None,
        rank_offset: int = 0,
        backend: str | None = None,
        timeout: float | timedelta | None = None,
    ) -> None:
        sync.require_initialized()
        if len(size) == 1 and isinstance(size[0], (tuple, list)):
            size = tuple(size[0])
        self._layout = MeshLayout(size, axis_names, rank_offset)  # type: ignore[arg-type]
        world_size = dist.get_world_size()
        needed = self._layout.size + rank_offset
        if needed > world_size:
            raise ArgumentError(
                f"the mesh {self._layout.shape} holds {self._layout.size} ranks from rank offset {rank_offset}, "
                f"so it needs a world of at least {needed} ranks, but the world size is {world_size}"
            )
        self._rank = dist.get_rank()
        self._backend = backend
        self._ranks_to_group: dict[tuple[tuple[int, ...], str], dist.ProcessGroup | None] = {}
        self._group_to_ranks: dict[dist.ProcessGroup, tuple[int, ...]] = {}
        self._check_agreement(sync.resolve_timeout(timeout))

    def _check_agreement(self, timeout: float) -> None:
        mine = msgpack.packb(
            [list(self.shape), list(self.axis_names or ()), self.layout.rank_offset, self._backend]
        )
        first, differing = sync.companion(None).agree(mine, timeout, what="checking the mesh layout")
        if differing:
            rank, other = next(iter(differing.items()))
            verb = "differs" if len(differing) == 1 else "differ"
            raise ArgumentError(
                f"ranks disagree on the mesh: rank 0 has (shape, names, offset, backend) "
                f"{tuple(msgpack.unpackb(first))}, {plural_list('rank', sorted(differing))} {verb} (rank {rank} has "
                f"{tuple(msgpack.unpackb(other))}); construct the mesh with the same arguments on every rank"
            )

    # -- properties ---------------------------------------------------------------------------------
    @property
    def layout(self) -> MeshLayout:
        """The pure rank arithmetic of this mesh."""
        return self._layout

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each axis."""
        return self._layout.shape

    @property
    def axis_names(self) -> tuple[str, ...] | None:
        """Axis names, or None."""
        return self._layout.axis_names

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self._rank

    def size(self, axis: AxisSpec | None = None) -> int | tuple[int, ...]:
        """The whole shape, or the size of ``axis`` (an index or a name).

        "Axis" is a mesh dimension, "dim" a tensor one (torchtitan's rule); ColossalAI calls this
        parameter ``dim``: positional calls are the same."""
        if axis is None:
            return self.shape
        return self.shape[self._layout.axis_index(axis)]

    def coordinate(self, axis: AxisSpec | None = None) -> int | tuple[int, ...]:
        """This rank's coordinate, or its index along ``axis``.

        Raises:
            ValueError: this rank lies outside the mesh.
        """
        coord = self._layout.coordinate(self._rank)
        return coord if axis is None else coord[self._layout.axis_index(axis)]

    def __repr__(self) -> str:
        return f"ProcessGroupMesh({self._layout!r}, rank={self._rank})"

    # -- static helpers (ColossalAI-compatible) -----------------------------------------------------
    @staticmethod
    def unravel(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        """Coordinate of linear index ``rank`` in ``shape`` (row-major)."""
        return MeshLayout.unravel(rank, shape)

    @staticmethod
    def ravel(coord: Sequence[int], shape: Sequence[int], mode: RavelMode = "raise") -> int:
        """Linear index of ``coord`` in ``shape`` (row-major); ``mode`` as in numpy."""
        return MeshLayout.ravel(coord, shape, mode)

    @staticmethod
    def get_coords_along_axis(
        base_coord: Sequence[int], axis: int | Sequence[int], indices_at_axis: IndicesAtAxis
    ) -> list[tuple[int, ...]]:
        """Coordinates equal to ``base_coord`` except along ``axis``, which takes ``indices_at_axis``.

        For several axes, ``indices_at_axis`` holds one list per axis and every combination is
        returned, the last axis varying fastest.
        """
        axes = [axis] if isinstance(axis, int) else list(axis)
        if isinstance(axis, int):
            per_axis = [list(cast("Sequence[int]", indices_at_axis or []))]
        else:
            per_axis = [list(i) for i in cast("Sequence[Sequence[int]]", indices_at_axis or [])]
        if len(per_axis) != len(axes):
            raise ArgumentError(
                f"indices_at_axis needs one list per axis: {len(axes)} axes, {len(per_axis)} lists"
            )
        coords = [tuple(base_coord)]
        for ax, picked in zip(axes, per_axis):
            coords = [(*c[:ax], i, *c[ax + 1 :]) for c in coords for i in picked]
        return coords

    # -- groups ---------------------------------------------------------------------------------------
    def _resolve_backend(self, backend: str | None) -> str:
        chosen = backend or self._backend
        return str(chosen) if chosen is not None else str(dist.get_backend())

    @property
    def backend(self) -> str | None:
        """Default backend of the groups this mesh creates (None: the world's backend)."""
        return self._backend

    def create_group_along_axis(
        self,
        axis: AxisSpec | Sequence[AxisSpec],
        indices_at_axis: IndicesAtAxis = None,
        backend: str | None = None,
        *,
        pg_options: object | None = None,
        group_desc: str | None = None,
    ) -> dist.ProcessGroup | None:
        """Create every group along ``axis`` (cached) and return this rank's, or None.

        Must be called on every rank of the world with the same arguments (see module doc).
        Groups are cached by (ranks, backend): a gloo request never returns an NCCL group.
        ``pg_options`` and ``group_desc`` go to ``torch.distributed.new_group`` (as Megatron's
        ``HyperCommGrid.create_pg`` passes them).
        """
        backend_name = self._resolve_backend(backend)
        mine: dist.ProcessGroup | None = None
        member = False
        extra: dict[str, Any] = {}
        if pg_options is not None:
            extra["pg_options"] = pg_options
        if group_desc is not None:
            extra["group_desc"] = group_desc
        for ranks in self._layout.groups_along(axis, indices_at_axis):
            key = (tuple(ranks), backend_name)
            if key not in self._ranks_to_group:
                group = dist.new_group(ranks, backend=backend_name, **extra)
                is_member = self._rank in ranks
                self._ranks_to_group[key] = group if is_member else None
                if is_member:
                    self._group_to_ranks[group] = tuple(ranks)
                logger.debug("created %s group %s", backend_name, ranks)
            if self._rank in ranks:
                member = True
                mine = self._ranks_to_group[key]
        return mine if member else None

    def get_group_along_axis(
        self,
        axis: AxisSpec | Sequence[AxisSpec],
        indices_at_axis: IndicesAtAxis = None,
        backend: str | None = None,
        *,
        pg_options: object | None = None,
        group_desc: str | None = None,
    ) -> dist.ProcessGroup | None:
        """This rank's group along ``axis``, created (collectively, see module doc) if not cached.

        A rank in none of the groups (``indices_at_axis`` leaves it out, as ColossalAI's pipeline
        stage manager asks for ``get_group_along_axis(0, [0, 2])`` on every rank) still takes
        part in creating them, so every rank's creation count stays in step, and gets None.
        """
        try:
            ranks: list[int] | None = self.ranks_along_axis(axis, indices_at_axis)
        except ValueError:
            self._layout.groups_along(axis, indices_at_axis)  # a bad axis or index raises here
            ranks = None  # not a member of any of these groups
        if ranks is not None:
            key = (tuple(ranks), self._resolve_backend(backend))
            if key in self._ranks_to_group:
                return self._ranks_to_group[key]
        return self.create_group_along_axis(
            axis, indices_at_axis, backend, pg_options=pg_options, group_desc=group_desc
        )

    def cached_group_along_axis(
        self,
        axis: AxisSpec | Sequence[AxisSpec],
        indices_at_axis: IndicesAtAxis = None,
        backend: str | None = None,
    ) -> dist.ProcessGroup | None:
        """This rank's group along ``axis`` if it was created already, else None (no communication)."""
        key = (tuple(self.ranks_along_axis(axis, indices_at_axis)), self._resolve_backend(backend))
        return self._ranks_to_group.get(key)

    def ranks_along_axis(
        self, axis: AxisSpec | Sequence[AxisSpec], indices_at_axis: IndicesAtAxis = None
    ) -> list[int]:
        """Global ranks of this rank's group along ``axis`` (no communication)."""
        return self._layout.group_of(self._rank, axis, indices_at_axis)

    def get_ranks_in_group(self, group: dist.ProcessGroup) -> list[int]:
        """Global ranks of ``group``."""
        if group in self._group_to_ranks:
            return list(self._group_to_ranks[group])
        return dist.get_process_group_ranks(group)

    def barrier(
        self, axis: AxisSpec | Sequence[AxisSpec] | None = None, timeout: float | timedelta | None = None
    ) -> None:
        """Barrier over this rank's group along ``axis`` (the whole mesh when None).

        Must be called on every rank of that group; runs on the CPU companion of its ranks,
        so independent groups proceed concurrently and NCCL groups are never touched.

        Raises:
            PeerLostError: naming the ranks that did not arrive within ``timeout``.
        """
        ranks = list(self._layout.ranks) if axis is None else self.ranks_along_axis(axis)
        sync.barrier(ranks, timeout)

    def destroy_mesh_process_groups(self) -> None:
        """Destroy the groups this mesh created. Idempotent; safe after a partial init."""
        groups = [g for g in self._ranks_to_group.values() if g is not None]
        self._ranks_to_group.clear()
        self._group_to_ranks.clear()
        if not dist.is_initialized():
            return
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                logger.debug("group already destroyed", exc_info=True)

    def to_device_mesh(self, device_type: str) -> torch.distributed.device_mesh.DeviceMesh:
        """A torch ``DeviceMesh`` with this layout and axis names (collective on every rank)."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self._layout.rank_offset, self._layout.rank_offset + math.prod(self.shape))
        return DeviceMesh(device_type, ranks.reshape(self.shape), mesh_dim_names=self.axis_names)
