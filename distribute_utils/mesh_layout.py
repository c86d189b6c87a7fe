"""Pure rank arithmetic of an N-dimensional process mesh; no process group needed.

Ranks are laid out row-major (the last axis varies fastest), as in torch's
``DeviceMesh`` and ColossalAI's ``ProcessGroupMesh``. :meth:`MeshLayout.from_order`
builds the same layout from Megatron's convention, where the *first* name varies
fastest (``"tp-cp-pp-dp"``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

from .errors import ArgumentError, UnknownNameError, UnsupportedTypeError

__all__ = ["AxisSpec", "MeshLayout", "RavelMode"]

RavelMode = Literal["raise", "wrap", "clip"]
AxisSpec = int | str
_RAVEL_MODES = ("raise", "wrap", "clip")


class MeshLayout:
    """Immutable description of how global ranks tile an N-dimensional mesh.

    Args:
        shape: size of each axis; every size must be a positive int.
        axis_names: one unique name per axis (optional).
        rank_offset: global rank of the mesh's coordinate ``(0, ..., 0)``.

    Raises:
        ValueError: on a bad shape, names of the wrong count, duplicates or a negative offset.
    """

    __slots__ = ("_axis_names", "_rank_offset", "_shape", "_strides")

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str] | None = None,
        rank_offset: int = 0,
    ) -> None:
        shape = tuple(shape)
        if not shape:
            raise ArgumentError("a mesh needs at least one axis; got shape ()")
        for size in shape:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ArgumentError(f"mesh sizes must be positive ints; got shape {shape}")
        if axis_names is not None:
            axis_names = tuple(axis_names)
            if len(axis_names) != len(shape):
                raise ArgumentError(
                    f"got {len(axis_names)} axis names {axis_names} for a {len(shape)}-axis shape {shape}; "
                    "give exactly one name per axis"
                )
            if not all(isinstance(name, str) and name for name in axis_names):
                raise ArgumentError(f"axis names must be non-empty strings; got {axis_names}")
            duplicates = sorted({name for name in axis_names if axis_names.count(name) > 1})
            if duplicates:
                raise ArgumentError(
                    f"duplicate axis names {duplicates} in {axis_names}; names must be unique"
                )
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ArgumentError(f"rank_offset must be an int >= 0; got {rank_offset!r}")
        self._shape: tuple[int, ...] = shape
        self._axis_names: tuple[str, ...] | None = axis_names
        self._rank_offset = rank_offset
        strides = [1] * len(shape)
        for axis in range(len(shape) - 2, -1, -1):
            strides[axis] = strides[axis + 1] * shape[axis + 1]
        self._strides: tuple[int, ...] = tuple(strides)

    @classmethod
    def from_order(cls, order: str, rank_offset: int = 0, **sizes: int) -> MeshLayout:
        """Build a layout from Megatron's order string, whose first name varies fastest.

        ``MeshLayout.from_order("tp-cp-pp-dp", tp=2, cp=3, pp=4, dp=5)`` gives the groups of
        Megatron's ``RankGenerator`` / ``HyperCommGrid`` for that order. The returned layout is
        row-major with the axes reversed: shape ``(5, 4, 3, 2)``, names ``("dp", "pp", "cp", "tp")``.

        Raises:
            ValueError: when a name in ``order`` has no size, or a size has no name.
        """
        names = [name for name in order.split("-") if name]
        if not names:
            raise ArgumentError(f"order {order!r} names no axis; use names joined by '-', e.g. 'tp-pp-dp'")
        missing = [name for name in names if name not in sizes]
        extra = sorted(set(sizes) - set(names))
        if missing or extra:
            raise ArgumentError(
                f"order {order!r} and sizes {sizes} disagree: no size for {missing}, no place for {extra}; "
                "give exactly one size per name in the order"
            )
        return cls([sizes[name] for name in reversed(names)], list(reversed(names)), rank_offset)

    # -- basic properties -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...] | None:
        """Name of each axis, or None when the mesh is unnamed."""
        return self._axis_names

    @property
    def rank_offset(self) -> int:
        """Global rank of coordinate ``(0, ..., 0)``."""
        return self._rank_offset

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return math.prod(self._shape)

    @property
    def ranks(self) -> range:
        """Global ranks of the mesh, in order."""
        return range(self._rank_offset, self._rank_offset + self.size)

    def __repr__(self) -> str:
        names = f", axis_names={self._axis_names}" if self._axis_names else ""
        offset = f", rank_offset={self._rank_offset}" if self._rank_offset else ""
        return f"MeshLayout(shape={self._shape}{names}{offset})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MeshLayout):
            return NotImplemented
        return (self._shape, self._axis_names, self._rank_offset) == (
            other._shape,
            other._axis_names,
            other._rank_offset,
        )

    def __hash__(self) -> int:
        return hash((self._shape, self._axis_names, self._rank_offset))

    # -- axes ---------------------------------------------------------------------------------------
    def axis_index(self, axis: AxisSpec) -> int:
        """Index of ``axis``, given as an int (negative counts from the end) or a name.

        Raises:
            KeyError: an unknown name (the message lists the valid ones).
            ValueError: an index out of range.
        """
        if isinstance(axis, str):
            if self._axis_names is None or axis not in self._axis_names:
                valid = list(self._axis_names) if self._axis_names else "none: the mesh is unnamed"
                raise UnknownNameError(f"unknown axis name {axis!r}; valid names: {valid}")
            return self._axis_names.index(axis)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise UnsupportedTypeError(f"an axis is an int or a name; got {axis!r}")
        if not -self.ndim <= axis < self.ndim:
            raise ArgumentError(
                f"axis {axis} is out of range for a {self.ndim}-axis mesh; valid: 0..{self.ndim - 1}"
            )
        return axis % self.ndim

    def axes_indices(self, axes: AxisSpec | Sequence[AxisSpec]) -> tuple[int, ...]:
        """Indices of one axis or several, validated, duplicates refused."""
        seq = [axes] if isinstance(axes, (int, str)) else list(axes)
        if not seq:
            raise ArgumentError(
                f"give at least one axis (an int in {-self.ndim}..{self.ndim - 1} or a name); got none"
            )
        indices = tuple(self.axis_index(axis) for axis in seq)
        if len(set(indices)) != len(indices):
            raise ArgumentError(f"axes {seq} name the same axis twice; name each axis once")
        return indices

    # -- coordinates ------------------------------------------------------------------------------
    @staticmethod
    def ravel(coord: Sequence[int], shape: Sequence[int], mode: RavelMode = "raise") -> int:
        """Row-major linear index of ``coord`` in ``shape`` (no rank offset).

        Args:
            mode: ``"raise"`` refuses coordinates out of range, ``"wrap"`` takes them modulo the
                axis size, ``"clip"`` clamps them into range.
        """
        if mode not in _RAVEL_MODES:
            raise ArgumentError(f"unknown ravel mode {mode!r}; valid: {list(_RAVEL_MODES)}")
        coord, shape = tuple(coord), tuple(shape)
        if len(coord) != len(shape):
            raise ArgumentError(
                f"coordinate {coord} has {len(coord)} entries for a {len(shape)}-axis shape {shape}"
            )
        index = 0
        for axis, (c, n) in enumerate(zip(coord, shape)):
            c = int(c)
            if not 0 <= c < n:
                if mode == "raise":
                    raise ArgumentError(
                        f"coordinate {coord} is out of range on axis {axis}: {c} not in 0..{n - 1} (shape {shape})"
                    )
                c = c % n if mode == "wrap" else min(max(c, 0), n - 1)
            index = index * n + c
        return index

    @staticmethod
    def unravel(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        """Row-major coordinate of linear index ``rank`` in ``shape`` (no rank offset)."""
        shape = tuple(shape)
        total = math.prod(shape)
        rank = int(rank)
        if not 0 <= rank < total:
            raise ArgumentError(f"index {rank} is out of range for shape {shape}; valid: 0..{total - 1}")
        coord = []
        for n in reversed(shape):
            rank, c = divmod(rank, n)
            coord.append(c)
        return tuple(reversed(coord))

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Coordinate of global ``rank``.

        Raises:
            ValueError: ``rank`` is not in this mesh (the message gives the valid range).
        """
        self._check_rank(rank)
        return self.unravel(rank - self._rank_offset, self._shape)

    def rank(self, coord: Sequence[int]) -> int:
        """Global rank at ``coord`` (coordinates out of range raise ``ValueError``)."""
        return self._rank_offset + self.ravel(coord, self._shape)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in self.ranks:
            raise ArgumentError(
                f"rank {rank!r} is not in {self!r}; valid ranks: "
                f"{self._rank_offset}..{self._rank_offset + self.size - 1}"
            )

    # -- groups -----------------------------------------------------------------------------------
    def groups_along(
        self,
        axes: AxisSpec | Sequence[AxisSpec],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes``.

        Each group lists its global ranks in ascending order; groups come ordered by their first
        rank. With ``indices_at_axis``, only those indices along each grouped axis take part
        (a flat list for one axis, one list per axis for several), as in ColossalAI.
        """
        grouped = self.axes_indices(axes)
        selection = self._normalise_indices(grouped, indices_at_axis)
        grid = torch.arange(self.size, dtype=torch.int64).reshape(self._shape)
        for axis, picked in zip(grouped, selection):
            if picked is not None:
                grid = grid.index_select(axis, torch.tensor(picked, dtype=torch.int64))
        kept = [axis for axis in range(self.ndim) if axis not in grouped]
        group_size = math.prod(grid.shape[axis] for axis in grouped)
        grid = grid.permute(*kept, *sorted(grouped)).reshape(-1, group_size)
        if self._rank_offset:
            grid = grid + self._rank_offset
        return grid.tolist()

    def group_of(
        self,
        rank: int,
        axes: AxisSpec | Sequence[AxisSpec],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[int]:
        """The group along ``axes`` that ``rank`` belongs to (ascending global ranks).

        Raises:
            ValueError: ``rank`` is outside the mesh, or its index along a grouped axis is not
                among ``indices_at_axis``.
        """
        coord = list(self.coordinate(rank))
        grouped = self.axes_indices(axes)
        selection = self._normalise_indices(grouped, indices_at_axis)
        choices: list[Iterable[int]] = [[c] for c in coord]
        for axis, picked in zip(grouped, selection):
            if picked is not None and coord[axis] not in picked:
                raise ArgumentError(
                    f"rank {rank} has index {coord[axis]} on axis {axis}, which is not among "
                    f"indices_at_axis {list(picked)}; it belongs to no such group"
                )
            choices[axis] = picked if picked is not None else range(self._shape[axis])
        return sorted(self.rank(c) for c in itertools.product(*choices))

    def _normalise_indices(
        self,
        grouped: tuple[int, ...],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None,
    ) -> list[list[int] | None]:
        if indices_at_axis is None:
            return [None] * len(grouped)
        items: list[Any] = list(indices_at_axis)  # checked below: ints, or one sequence per axis
        if len(grouped) == 1 and all(isinstance(i, int) for i in items):
            per_axis: list[Sequence[int] | None] = [items]
        else:
            per_axis = [None if i is None else list(i) for i in items]
        if len(per_axis) != len(grouped):
            raise ArgumentError(
                f"indices_at_axis has {len(per_axis)} entries for {len(grouped)} axes; give one list per axis"
            )
        result: list[list[int] | None] = []
        for axis, picked in zip(grouped, per_axis):
            if picked is None:
                result.append(None)
                continue
            picked = [int(i) for i in picked]
            n = self._shape[axis]
            bad = [i for i in picked if not 0 <= i < n]
            if bad or not picked or len(set(picked)) != len(picked):
                raise ArgumentError(
                    f"indices_at_axis {picked} for axis {axis} must be distinct, non-empty and in 0..{n - 1}"
                )
            result.append(sorted(picked))
        return result
