"""Internal. Reading the planned output tensors of a DCP directory from its ``.distcp`` files: a batch at a time
through DCP's own storage reader (:meth:`DcpReader.read`), or streamed chunk by chunk straight into a
safetensors file (:meth:`DcpReader.stream_into`)."""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..errors import CheckpointFormatError, DistributeError, LayoutError
from .dcp_names import Region
from .merge_plan import MergePlanEntry
from .safetensors_writer import SafetensorsWriter
from .specs import tensor_bytes
from .unreadable import short_cause

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlanner

__all__ = ["DcpReader", "byte_runs"]

# A chunk whose overlap with a tensor comes in runs of at least this many bytes is written at once.
_DIRECT_RUN = 1 << 20  # DCP tensors are global already: one "shard" each, nothing to merge


class DcpReader:
    """Reads output tensors of a planned DCP directory; made by :class:`~.dcp.DcpCheckpoint` once it has
    planned (``regions``: where each planned tensor is, by name).

    Attributes:
        root: the directory.
    """

    def __init__(self, root: Path, reader: Any, metadata: Any, regions: Mapping[str, Region]) -> None:
        """``reader``: DCP's ``FileSystemReader`` of ``root``; ``metadata``: its ``Metadata``."""
        self.root = root
        self._reader, self._metadata, self._regions = reader, metadata, regions

    def read(self, entries: Sequence[MergePlanEntry]) -> list[torch.Tensor]:
        """The tensors of ``entries`` (from :meth:`~.dcp.DcpCheckpoint.plan`), read with one DCP ``read_data``
        call."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        items = []
        out = []
        for entry in entries:
            region = self._regions[entry.local_name]
            md = self._metadata.state_dict_metadata[region.key]
            full = tuple(md.size)
            lead = len(region.index)
            buf = torch.empty(entry.spec.shape, dtype=entry.spec.dtype)
            out.append(buf)
            offsets = torch.Size(region.index + (0,) * (len(full) - lead))
            sizes = torch.Size((1,) * lead + full[lead:])
            buffers[(region.key, tuple(offsets))] = buf.view(sizes)
            items += create_read_items_for_chunk_list(
                region.key, md, [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]
            )
        if not items:
            return out
        if not getattr(self._reader, "storage_data", None):
            self._reader.set_up_storage_reader(self._metadata, True)
        planner = _IntoBuffers(buffers)
        try:
            # _IntoBuffers is the part of a LoadPlanner that read_data calls
            self._reader.read_data(LoadPlan(items), cast("LoadPlanner", planner)).wait()
        except Exception as exc:
            raise self._damaged([item.storage_index for item in items], exc) from None
        expected = sum(math.prod(b.shape) for b in out)
        if planner.elements != expected:
            raise LayoutError(
                f"{self.root}: the stored chunks cover {planner.elements} of the {expected} elements of "
                f"{', '.join(e.name for e in entries[:3])}...; the checkpoint is incomplete"
            )
        return out

    def stream_into(self, writer: SafetensorsWriter, entries: Sequence[MergePlanEntry]) -> None:
        """Writes ``entries`` (from :meth:`~.dcp.DcpCheckpoint.plan`) straight into ``writer``'s file, tensor
        by tensor.

        Each stored chunk is loaded (once for consecutive tensors that share it) and its overlap with the
        tensor placed at its offsets, never building the tensor. A chunk whose overlap is one long run
        (split along the first dim) is written and dropped at once; chunks giving many short runs (split
        along a later dim) are held until the tensor's other chunks are loaded, so that each row is one
        ``pwritev``. At most one tensor's chunks are in memory.
        """
        if not getattr(self._reader, "storage_data", None):
            self._reader.set_up_storage_reader(self._metadata, True)
        loader = _ChunkLoader(self.root, self._reader.storage_data)
        try:
            for entry in entries:
                spec = entry.spec
                held: list[tuple[int, memoryview]] = []
                for key, lead, origin, offsets, sizes in self._overlaps(entry):
                    piece = loader.load(key)
                    for dim, (start, size) in enumerate(zip(offsets, sizes)):
                        if start - origin[dim] != 0 or size != piece.shape[dim]:
                            piece = piece.narrow(dim, start - origin[dim], size)
                    data = tensor_bytes(piece)
                    runs = [
                        (dst, data[src : src + n])
                        for dst, src, n in byte_runs(
                            spec.shape, offsets[lead:], sizes[lead:], spec.dtype.itemsize
                        )
                    ]
                    if len(runs) == 1 or min(len(r) for _, r in runs) >= _DIRECT_RUN:
                        writer.write_part(entry.name, spec.dtype, spec.shape, runs)
                    else:
                        held += runs
                    del piece, data, runs
                if held or spec.nbytes == 0:
                    writer.write_part(entry.name, spec.dtype, spec.shape, held)
                del held
        finally:
            loader.close()
        missing = set(writer.missing)
        short = [e.name for e in entries if e.name in missing]
        if short:
            raise LayoutError(
                f"{self.root}: the stored chunks do not cover tensors {short[:3]}; the checkpoint is incomplete"
            )

    def _damaged(self, keys: Sequence[Any], exc: Exception) -> Exception:
        """The error for a failed read of stored items: the first item that cannot be loaded, file named."""
        if isinstance(exc, DistributeError):
            return exc
        loader = _ChunkLoader(self.root, self._reader.storage_data)
        try:
            for key in dict.fromkeys(keys):
                try:
                    loader.load(key)
                except CheckpointFormatError as found:
                    return found
        finally:
            loader.close()
        return exc

    def _overlaps(
        self, entry: MergePlanEntry
    ) -> list[tuple[Any, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """``(storage key, leading dims, chunk origin, overlap offsets, overlap sizes)`` for each stored chunk
        overlapping an output tensor, in global coordinates."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        region = self._regions[entry.local_name]
        md = self._metadata.state_dict_metadata[region.key]
        full = tuple(md.size)
        lead = len(region.index)
        box = (region.index + (0,) * (len(full) - lead), (1,) * lead + full[lead:])
        out = []
        for i, chunk in enumerate(md.chunks):
            overlap = _intersect(box, (tuple(chunk.offsets), tuple(chunk.sizes)))
            if overlap is not None:
                out.append(
                    (MetadataIndex(region.key, chunk.offsets, i), lead, tuple(chunk.offsets), *overlap)
                )
        return out


class _ChunkLoader:
    """Loads stored DCP items by key (``torch.load`` of a view of the file, weights only), keeping the
    last one for the next tensor that shares it; the previous one is dropped before the next is read."""

    def __init__(self, root: Path, storage: Mapping[Any, Any]) -> None:
        self._root, self._storage = root, storage
        self._files: dict[str, Any] = {}
        self._key: Any = None
        self._chunk: torch.Tensor | None = None

    def load(self, key: Any) -> torch.Tensor:
        if key == self._key and self._chunk is not None:
            return self._chunk
        self._key = self._chunk = None
        info = self._storage[key]
        if getattr(info, "transform_descriptors", None):
            raise LayoutError(
                f"{self._root}: '{key.fqn}' is stored with transforms {info.transform_descriptors}, which "
                "this reader does not apply"
            )
        f = self._files.get(info.relative_path)
        if f is None:
            f = self._files[info.relative_path] = open(self._root / info.relative_path, "rb")  # noqa: SIM115
        try:
            # torch.load hints IO[bytes]; its documented contract is any file-like object (read, seek, tell)
            chunk = torch.load(_FileView(f, info.offset, info.length), map_location="cpu", weights_only=True)  # type: ignore[arg-type]
        except Exception as exc:  # a damaged item: torch raises anything (RuntimeError, EOFError, ...)
            raise CheckpointFormatError(
                f"checkpoint file '{self._root / info.relative_path}' is corrupt: item '{key.fqn}' (bytes "
                f"{info.offset} to {info.offset + info.length}) cannot be read ({short_cause(exc)}); copy or save "
                "it again (it cannot be consolidated as it is)"
            ) from None
        if not isinstance(chunk, torch.Tensor):
            raise LayoutError(f"{self._root}: '{key.fqn}' is stored as {type(chunk).__name__}, not a tensor")
        self._key, self._chunk = key, chunk
        return chunk

    def close(self) -> None:
        self._key = self._chunk = None
        for f in self._files.values():
            f.close()
        self._files.clear()


def _intersect(
    a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The overlap of two boxes ``(offsets, sizes)``, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi))


def byte_runs(
    shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], itemsize: int
) -> list[tuple[int, int, int]]:
    """A box of a row-major tensor as contiguous runs: ``(byte offset in the tensor, byte offset in the box's
    own row-major bytes, length)``."""
    k = len(shape) - 1
    while k >= 0 and sizes[k] == shape[k] and offsets[k] == 0:
        k -= 1
    if k < 0:
        return [(0, 0, math.prod(shape) * itemsize)]
    strides = [math.prod(shape[j + 1 :]) * itemsize for j in range(len(shape))]
    length = sizes[k] * strides[k]
    runs = []
    src = 0
    for index in itertools.product(*(range(n) for n in sizes[:k])):
        dst = sum((offsets[j] + i) * strides[j] for j, i in enumerate(index)) + offsets[k] * strides[k]
        runs.append((dst, src, length))
        src += length
    return runs


class _FileView(io.RawIOBase):
    """``length`` bytes of an open file from ``offset``, seekable, so ``torch.load`` reads one stored item
    without a copy of its bytes."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


class _IntoBuffers:
    """The part of DCP's ``LoadPlanner`` that ``FileSystemReader.read_data`` calls: every read item lands
    in its slice of a preallocated buffer."""

    def __init__(self, buffers: Mapping[tuple[str, tuple[int, ...]], torch.Tensor]) -> None:
        self._buffers = buffers
        self.elements = 0

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        buf = self._buffers[(item.dest_index.fqn, tuple(item.dest_index.offset))]
        return narrow_tensor_by_index(buf, item.dest_offsets, item.lengths)

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        self.elements += tensor.numel()

    def load_bytes(self, item: Any, value: Any) -> None:
        raise LayoutError(f"unexpected bytes entry '{item.dest_index.fqn}' in a tensor read")
