"""Internal. torch.distributed.checkpoint (DCP) directories, read tensor by tensor: plain DCP and Megatron's torch_dist.

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

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import ArgumentError, CheckpointFormatError, LayoutError
from ..mesh_layout import MeshLayout
from .dcp_metadata import DCP_METADATA, is_megatron_dcp, megatron_args, read_dcp_metadata
from .dcp_names import MEGATRON_NAMES, DcpNaming, Region, model_order
from .dcp_stream import DcpReader, byte_runs
from .merge_plan import MergePlanEntry
from .merge_rules import Unknown
from .reading import BatchReads
from .safe_load import UnsafeCheckpointError
from .safetensors_writer import SafetensorsWriter
from .unreadable import describe_unreadable
from .writer_base import CheckpointWriter

if TYPE_CHECKING:
    from .rule_table import RuleChoice

__all__ = ["DcpCheckpoint", "byte_runs", "read_dcp_metadata"]

logger = logging.getLogger(__name__)

_WHOLE = Unknown()


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
        self.megatron = is_megatron_dcp(self.root)
        self.args = megatron_args(self.root) if self.megatron else None
        impl = getattr(self.args, "transformer_impl", None)
        self.names = names or ("local" if impl == "local" else "te")
        self.grouped_experts = bool(getattr(self.args, "moe_grouped_gemm", False))
        self._regions: dict[str, Region] = {}
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

    @property
    def model_args(self) -> Any:
        """Megatron's ``args`` (``common.pt``), or None: what a conversion reads its facts from."""
        return self.args

    def describe_grid(self) -> str:
        return "a torch.distributed.checkpoint"

    def describe_stage(self, stage: int) -> str:
        return "the checkpoint"

    def stage_ranks(self, stage: int) -> list[int]:
        """One process reads the whole checkpoint (see :meth:`CheckpointLayout.stage_ranks`)."""
        return [0]

    def where(self, message: str) -> str:
        """Nothing to add: a DCP checkpoint's tensors are global, never merged across files."""
        return ""

    def left_out(self) -> list[tuple[str, str]]:
        """``(key, why)`` of the entries no output tensor comes from: values that are not tensors (a
        training state's step, an optimizer's param_groups: DCP stores them as pickled bytes, which are
        never unpickled here), and Megatron's entries that are not model weights."""
        self.plan()
        used = {region.key for region in self._regions.values()}
        found = []
        for key, md in self._metadata.state_dict_metadata.items():
            if key in used:
                continue
            tensor = type(md).__name__ == "TensorStorageMetadata"
            found.append((key, "not a model weight" if tensor else "not a tensor"))
        return found

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

    def plan(self, rules: RuleChoice | None = None) -> list[MergePlanEntry]:
        """One entry per output tensor, layer by layer (metadata only); global tensors: ``rules`` do not
        apply."""
        if rules is not None and rules.given:
            logger.info("%s holds global tensors: merge rules and quant_format do not apply", self.root)
        if self._plan is None:
            naming = DcpNaming(self.root, self.megatron, self.names, self.grouped_experts)
            entries = naming.entries(self._metadata)
            seen: dict[str, str] = {}
            for name, region, _ in entries:
                if name in seen:
                    raise LayoutError(
                        f"{self.root}: DCP entries '{seen[name]}' and '{region.key}' both give tensor '{name}'"
                    )
                seen[name] = region.key
            entries.sort(key=model_order)
            self._regions = {name: region for name, region, _ in entries}
            self._plan = [MergePlanEntry(name, 0, name, _WHOLE, spec) for name, _, spec in entries]
        return list(self._plan)

    def region(self, name: str) -> Region:
        """Which DCP entry, and which leading index of it, gives output tensor ``name`` (of :meth:`plan`)."""
        if self._plan is None:
            self.plan()
        return self._regions[name]

    # ----------------------------------------------------------------------------------------------------
    # Reading (:mod:`.dcp_stream`).

    def read(self, entries: Sequence[MergePlanEntry]) -> list[torch.Tensor]:
        """The tensors of ``entries`` (from :meth:`plan`), read with one DCP ``read_data`` call."""
        return self._reads().read(entries)

    def stream_into(self, writer: SafetensorsWriter, entries: Sequence[MergePlanEntry]) -> None:
        """Writes ``entries`` (from :meth:`plan`) straight into ``writer``'s file, tensor by tensor, never
        building a tensor (:meth:`~.dcp_stream.DcpReader.stream_into`)."""
        self._reads().stream_into(writer, entries)

    def _reads(self) -> DcpReader:
        """A reader of the planned tensors (plans first if :meth:`plan` was not called yet)."""
        if self._plan is None:
            self.plan()
        return DcpReader(self.root, self._reader, self._metadata, self._regions)
