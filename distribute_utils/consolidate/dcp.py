"""torch.distributed.checkpoint (DCP) directories, read tensor by tensor: plain DCP and Megatron's torch_dist.

A DCP directory holds ``.metadata`` (every tensor's global shape and where its chunks are) and
``__<rank>_<n>.distcp`` files. :class:`DcpCheckpoint` plans the output from the metadata alone and reads
one batch of output tensors at a time through DCP's own storage reader (``FileSystemReader.read_data``
with a planner that places each stored chunk straight into the batch's buffers), so the whole model is
never in memory (torch's ``dcp_to_torch_save`` loads all of it).

**Plain DCP** (FSDP, torchtitan): every tensor entry is written under its key, unchanged.

**Megatron-LM / NeMo torch_dist** (``metadata.json`` says ``"sharded_backend": "torch_dist"``): keys are
Megatron's sharded keys, turned into the names of Megatron's own TP1 x PP1 x EP1 state dict:

* ``decoder.layers.<rest>`` has the layers stacked on axis 0: one output ``decoder.layers.<l>.<rest>`` per
  layer (any ``layers.`` not followed by an index, e.g. ``mtp.layers.``, likewise);
* ``mlp.experts.experts.<rest>`` has the experts stacked on the next axis: ``mlp.experts.local_experts.<e>.
  <rest>`` (``SequentialMLP``), or ``mlp.experts.<rest><e>`` when ``args.moe_grouped_gemm`` (TE's grouped
  MLP);
* TransformerEngine fuses the layer norms into the next linear layer and Megatron's sharded keys always
  use the fused names (``self_attention.linear_qkv.layer_norm_weight``); a model built with
  ``--transformer-impl local`` names them ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``.
  ``args.transformer_impl`` in ``common.pt`` decides; ``names=`` overrides;
* SwiGLU's ``linear_fc1`` is stored by Megatron's split factory as one global ``[gate; up]`` tensor, which
  is already the TP1 layout;
* ``_extra_state`` entries (TransformerEngine FP8 metadata), the optimizer, RNG and rerun states are not
  model weights and are left out.

``.metadata`` is a pickle. It is read with :func:`read_dcp_metadata`, never ``pickle.load`` (which DCP's own
``FileSystemReader.read_metadata`` uses): only the classes a DCP metadata file holds are built, and a file
naming anything else is refused by name (:class:`~.safe_load.UnsafeCheckpointError`) before any of it runs.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PosixPath
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from ..errors import ArgumentError, DistributeError, UnsupportedTypeError
from ..mesh_layout import MeshLayout
from .layouts import LayoutError, MergePlanEntry
from .reading import BatchReads
from .rules import Unknown
from .safe_load import UnsafeCheckpointError, safe_pickle_load, safe_torch_load
from .writers import (
    CheckpointFormatError,
    CheckpointWriter,
    SafetensorsWriter,
    TensorSpec,
    _cause,
    describe_unreadable,
    tensor_bytes,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlanner

    from .plan import RuleChoice

__all__ = ["DCP_METADATA", "MEGATRON_NAMES", "DcpCheckpoint", "byte_runs", "read_dcp_metadata"]

logger = logging.getLogger(__name__)

#: The metadata file of a DCP directory.
DCP_METADATA = ".metadata"
#: Naming schemes for Megatron's layer norms: TransformerEngine's fused names, or the local spec's.
MEGATRON_NAMES = ("te", "local")
_STACKED_LAYERS = re.compile(r"(?<![^.])layers\.(?!\d)")
_STACKED_EXPERTS = "mlp.experts.experts."
_NOT_WEIGHTS = ("optimizer.", "rng_state", "rerun_state_machine")
_LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_WHOLE = Unknown()
# A chunk whose overlap with a tensor comes in runs of at least this many bytes is written at once.
_DIRECT_RUN = 1 << 20  # DCP tensors are global already: one "shard" each, nothing to merge


@dataclass(frozen=True)
class _Region:
    """One output tensor: the leading ``index`` of DCP entry ``key``."""

    key: str
    index: tuple[int, ...]


class DcpCheckpoint:
    """A DCP directory, planned from its metadata and read in batches (see the module docstring).

    Presents the grid interface the consolidation driver uses with one shard of one stage, so that the
    single-process driver streams it like any other layout.

    Attributes:
        root: the directory.
        megatron: whether it is Megatron's torch_dist (keys renamed as described above).
        names: ``"te"`` or ``"local"`` layer-norm names (Megatron only).
        args: the ``args`` in ``common.pt`` (a ``Namespace``), or ``None``.
    """

    tp: ClassVar[int] = 1
    pp: ClassVar[int] = 1
    ep: ClassVar[int] = 1
    stages: ClassVar[int] = 1
    file_format: ClassVar[str] = "dcp"

    def __init__(self, root: str | Path, names: str | None = None) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.root = Path(root)
        if names is not None and names not in MEGATRON_NAMES:
            raise ArgumentError(f"names must be one of {', '.join(MEGATRON_NAMES)}, got {names!r}")
        self._reader = FileSystemReader(str(self.root))
        meta = self.root / DCP_METADATA
        try:
            self._metadata = read_dcp_metadata(meta)
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            problem = describe_unreadable(meta, exc, "DCP metadata file")
            raise LayoutError(f"{meta}: not readable DCP metadata: the file {problem}") from None
        # What FileSystemReader.read_metadata adds to what it unpickles (its own reads need only storage_data).
        if getattr(self._metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self._reader.load_id
        self._check_files()
        self.megatron = _is_megatron(self.root)
        self.args = _common_args(self.root) if self.megatron else None
        impl = getattr(self.args, "transformer_impl", None)
        self.names = names or ("local" if impl == "local" else "te")
        self.grouped_experts = bool(getattr(self.args, "moe_grouped_gemm", False))
        self._regions: dict[str, _Region] = {}
        self._plan: list[MergePlanEntry] | None = None

    def _check_files(self) -> None:
        """Every ``.distcp`` file the metadata names exists and is long enough for its items (a missing or
        truncated one is named before anything is read)."""
        needed: dict[str, int] = {}
        for info in self._metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(needed.items()):
            path = self.root / name
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint file '{path}' (named by {DCP_METADATA}) does not exist")
            size = path.stat().st_size
            if size < end:
                raise CheckpointFormatError(
                    f"checkpoint file '{path}' is truncated ({size} bytes; {DCP_METADATA} places items up to "
                    f"byte {end}); copy or save it again (it cannot be consolidated as it is)"
                )

    @property
    def kind(self) -> str:
        return "megatron_torch_dist" if self.megatron else "dcp"

    def describe_grid(self) -> str:
        return "a torch.distributed.checkpoint"

    def describe_stage(self, stage: int) -> str:
        return "the checkpoint"

    def stage_ranks(self, stage: int) -> list[int]:
        """One process reads the whole checkpoint (see :meth:`CheckpointLayout.stage_ranks`)."""
        return [0]

    @property
    def rank_grid(self) -> MeshLayout:
        """One rank (see :attr:`CheckpointLayout.rank_grid`)."""
        return MeshLayout((1, 1), axis_names=("stage", "tp"))

    def check_ranks(self, world: int, name: str | os.PathLike[str]) -> None:
        """Raises ValueError unless ``world`` is 1: one process streams it from its files."""
        if world != 1:
            raise ArgumentError(
                f"'{name}' is {self.describe_grid()}: one process streams it from its files; run the "
                f"consolidation on 1 rank, not {world}"
            )

    def open_shard(self, tp_rank: int, stage: int, batch_bytes: int) -> BatchReads:
        """The whole checkpoint, read batch by batch with :meth:`read`."""
        return BatchReads(self.read)

    def stream(self, writer: CheckpointWriter, entries: Sequence[MergePlanEntry]) -> bool:
        """:meth:`stream_into` a safetensors writer (True); False for any other writer."""
        if not isinstance(writer, SafetensorsWriter):
            return False
        self.stream_into(writer, entries)
        return True

    def __repr__(self) -> str:
        return f"DcpCheckpoint('{self.root}', kind={self.kind})"

    # ----------------------------------------------------------------------------------------------------
    # Planning.

    def _entries(self) -> list[tuple[str, _Region, TensorSpec]]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        out: list[tuple[str, _Region, TensorSpec]] = []
        for key, md in self._metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue  # bytes entries: _extra_state, RNG states, ...
            if self.megatron and ("_extra_state" in key or key.startswith(_NOT_WEIGHTS)):
                continue
            dtype = md.properties.dtype
            shape = tuple(md.size)
            if not self.megatron:
                out.append((key, _Region(key, ()), TensorSpec(key, dtype, shape)))
                continue
            for name, index in self._megatron_names(key, shape):
                out.append((name, _Region(key, index), TensorSpec(name, dtype, shape[len(index) :])))
        return out

    def _megatron_names(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """Output names of one Megatron key and the leading indices each takes."""
        names: list[tuple[str, tuple[int, ...]]] = [("", ())]
        rest = key
        while True:
            m = _STACKED_LAYERS.search(rest)
            e = rest.find(_STACKED_EXPERTS)
            if m is None and e < 0:
                break
            axis = len(names[0][1])
            if axis >= len(shape):
                raise LayoutError(
                    f"{self.root}: Megatron key '{key}' of shape {list(shape)} has more stacked axes "
                    "(layers., experts.) than dims"
                )
            if m is not None and (e < 0 or m.start() < e):
                head, rest = rest[: m.end()], rest[m.end() :]
                names = [(f"{n}{head}{i}.", (*idx, i)) for n, idx in names for i in range(shape[axis])]
            else:
                head, rest = rest[:e], rest[e + len(_STACKED_EXPERTS) :]
                if self.grouped_experts:  # TE's grouped MLP: experts.linear_fc1.weight<e>
                    return [
                        (f"{n}{head}mlp.experts.{rest}{i}", (*idx, i))
                        for n, idx in names
                        for i in range(shape[axis])
                    ]
                names = [
                    (f"{n}{head}mlp.experts.local_experts.{i}.", (*idx, i))
                    for n, idx in names
                    for i in range(shape[axis])
                ]
        if self.names == "local":
            rest = _LOCAL_NORMS.get(rest, rest)
        return [(n + rest, idx) for n, idx in names]

    def plan(self, rules: RuleChoice | None = None) -> list[MergePlanEntry]:
        """One entry per output tensor, layer by layer (metadata only); global tensors: ``rules`` do not
        apply."""
        if rules is not None and rules.given:
            logger.info("%s holds global tensors: merge rules and quant_format do not apply", self.root)
        if self._plan is None:
            entries = self._entries()
            seen: dict[str, str] = {}
            for name, region, _ in entries:
                if name in seen:
                    raise LayoutError(
                        f"{self.root}: DCP entries '{seen[name]}' and '{region.key}' both give tensor '{name}'"
                    )
                seen[name] = region.key
            entries.sort(key=_model_order)
            self._regions = {name: region for name, region, _ in entries}
            self._plan = [MergePlanEntry(name, 0, name, _WHOLE, spec) for name, _, spec in entries]
        return list(self._plan)

    # ----------------------------------------------------------------------------------------------------
    # Reading.

    def read(self, entries: Sequence[MergePlanEntry]) -> list[torch.Tensor]:
        """The tensors of ``entries`` (from :meth:`plan`), read with one DCP ``read_data`` call."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        if self._plan is None:
            self.plan()
        buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        items = []
        out = []
        for entry in entries:
            region = self._regions[entry.name]
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
        """Writes ``entries`` (from :meth:`plan`) straight into ``writer``'s file, tensor by tensor.

        Each stored chunk is loaded (once for consecutive tensors that share it) and its overlap with the
        tensor placed at its offsets, never building the tensor. A chunk whose overlap is one long run
        (split along the first dim) is written and dropped at once; chunks giving many short runs (split
        along a later dim) are held until the tensor's other chunks are loaded, so that each row is one
        ``pwritev``. At most one tensor's chunks are in memory.
        """
        if self._plan is None:
            self.plan()
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

        region = self._regions[entry.name]
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
                f"{info.offset} to {info.offset + info.length}) cannot be read ({_cause(exc)}); copy or save "
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


def _model_order(item: tuple[str, _Region, TensorSpec]) -> tuple[int, int]:
    """Embeddings, then layer by layer, then the rest (a stable sort keeps the key order within each)."""
    name, region, _ = item
    if name.startswith("embedding"):
        return (0, 0)
    return (1, region.index[0]) if region.index else (2, 0)


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


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` file names, as ``pickletools`` shows in the files that
    ``torch.distributed.checkpoint.save`` and megatron-core's torch_dist writer (torch 2.13, megatron-core
    0.16) write: DCP's metadata dataclasses and enums, ``torch.Size``, dtypes, layouts (pickled through
    ``torch.serialization._get_layout``, here a plain name lookup), ``pathlib.PosixPath`` (``checkpoint_id``)
    and, from megatron-core, the save plans it keeps for reuse (``all_local_plans``). Each builds plain data
    and runs nothing of the file's choosing."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed: dict[tuple[str, str], Any] = {}
    for module, names in (
        (
            metadata,
            (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            ),
        ),
        (filesystem, ("_StorageInfo", "_StoragePrefix")),
        (planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
    ):
        for name in names:
            allowed[(module.__name__, name)] = getattr(module, name)
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    allowed.update({("torch", k): v for k, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = layouts.__getitem__
    allowed[("collections", "OrderedDict")] = OrderedDict
    allowed[("pathlib", "PosixPath")] = PosixPath
    return allowed


def read_dcp_metadata(path: str | os.PathLike[str]) -> Any:
    """The ``Metadata`` of a DCP ``.metadata`` file, unpickled without running any of it.

    What ``FileSystemReader.read_metadata`` returns (less the ``load_id`` it stamps on), but only DCP's own
    classes are built (:func:`_metadata_globals`); anything else is refused before it is looked up.

    Raises:
        FileNotFoundError: no such file.
        UnsafeCheckpointError: the file names another global (a crafted file: the message names the file and
            the global; nothing was run).
        UnsupportedTypeError: (a ``TypeError``) the pickle holds something other than a ``Metadata``.
        Exception: what ``pickle`` raises on a damaged file (:class:`DcpCheckpoint` describes it).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    md = safe_pickle_load(
        path,
        _metadata_globals(),
        "A torch.distributed.checkpoint metadata file holds only DCP's own records; this one was not written "
        "by a DCP writer, and nothing in it was run: do not load it with torch either (it would run)",
    )
    if not isinstance(md, Metadata):
        raise UnsupportedTypeError(f"the pickle holds {type(md).__name__}, not DCP Metadata")
    return md


def _is_megatron(root: Path) -> bool:
    meta = root / "metadata.json"
    if not meta.is_file():
        return False
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{meta}: not valid JSON ({exc})") from None
    return isinstance(data, dict) and data.get("sharded_backend") == "torch_dist"


def _common_args(root: Path) -> Any:
    common = root / "common.pt"
    if not common.is_file():
        return None
    obj = safe_torch_load(common)
    return obj.get("args") if isinstance(obj, Mapping) else None
