"""Internal. Reading one shard's tensors batch by batch, with a bounded resident set: what
:meth:`~.formats.Checkpoint.open_shard` returns.

Call order (one reader per shard and process, one thread): :meth:`ShardReader.get` a batch's tensors, drop
them, then :meth:`ShardReader.batch_done`, and so on for each batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .merge_plan import MergePlanEntry

__all__ = ["BatchReads", "MappedShard", "ShardFiles", "ShardReader"]

# A memory-mapped shard is remapped after _REMAP_FACTOR * batch_bytes were read from it, so that pages already
# sent leave the resident set: re-parsing a safetensors header costs ~1 ms, re-unpickling a Megatron file
# (args, optimizer state, RNG states come along) ~20 ms, hence a wider window for torch files.
_REMAP_FACTOR = 1
_TORCH_REMAP_FACTOR = 4


class ShardReader(Protocol):
    """One shard's tensors, batch by batch (see the module docstring)."""

    def get(self, entries: Sequence[MergePlanEntry]) -> list[torch.Tensor]:
        """The tensors of ``entries`` in this shard (local names), in order."""
        ...

    def batch_done(self) -> None:
        """Called after a batch's tensors were dropped: the reader may release what it holds."""
        ...


class ShardFiles(Protocol):
    """What :class:`MappedShard` reads of a grid layout (:class:`~.grid.CheckpointLayout` is one)."""

    file_format: str

    def load_shard(self, tp_rank: int, stage: int) -> dict[str, torch.Tensor]: ...


class MappedShard:
    """One file of a grid layout, memory-mapped on first use.

    The file is remapped after about ``batch_bytes`` (four times as much for torch files) were taken from
    it, so that pages already sent or written leave this process's resident set.
    """

    def __init__(self, layout: ShardFiles, tp_rank: int, stage: int, batch_bytes: int) -> None:
        self._layout, self._tp, self._stage = layout, tp_rank, stage
        factor = _REMAP_FACTOR if layout.file_format == "safetensors" else _REMAP_FACTOR * _TORCH_REMAP_FACTOR
        self._window = batch_bytes * factor
        self._taken = 0
        self._tensors: dict[str, torch.Tensor] | None = None

    def get(self, entries: Sequence[MergePlanEntry]) -> list[torch.Tensor]:
        """See :meth:`ShardReader.get`."""
        if self._tensors is None:
            self._tensors = self._layout.load_shard(self._tp, self._stage)
        found = [self._tensors[e.local_name] for e in entries]
        self._taken += sum(t.numel() * t.element_size() for t in found)
        return found

    def batch_done(self) -> None:
        """See :meth:`ShardReader.batch_done`: maybe unmap the file."""
        if self._taken >= self._window:
            self._tensors = None
            self._taken = 0


class BatchReads:
    """A checkpoint read batch by batch through ``read(entries)`` (nothing held between batches)."""

    def __init__(self, read: Callable[[Sequence[MergePlanEntry]], list[torch.Tensor]]) -> None:
        self._read = read

    def get(self, entries: Sequence[MergePlanEntry]) -> list[torch.Tensor]:
        """See :meth:`ShardReader.get`."""
        return self._read(entries)

    def batch_done(self) -> None:
        """Nothing is held."""
