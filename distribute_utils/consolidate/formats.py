"""Internal. Recognising a checkpoint directory: :func:`open_checkpoint` is the one place that knows every format.

* ``mesh.json``: the own layout (:class:`~.own_layout.OwnLayout`);
* ``.metadata``: torch.distributed.checkpoint, which Megatron-LM and NeMo write as ``torch_dist``
  (:class:`~.dcp.DcpCheckpoint`);
* ``mp_rank_TT[_PPP][_EEE]`` directories: Megatron-LM legacy (:class:`~.megatron.MegatronLegacyLayout`).

Either of the last two may sit under Megatron's ``iter_NNNNNNN`` (``latest_checkpointed_iteration.txt``
names the latest, ``iteration`` picks another).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import LayoutError
from .dcp import DcpCheckpoint
from .dcp_metadata import DCP_METADATA
from .megatron import MEGATRON_FILE, TRACKER_FILE, find_megatron_root, open_megatron_legacy
from .own_layout import MESH_FILE, OwnLayout

if TYPE_CHECKING:
    from ..mesh_layout import MeshLayout
    from .merge_plan import MergePlanEntry
    from .reading import ShardReader
    from .rule_table import RuleChoice
    from .writer_base import CheckpointWriter

__all__ = ["Checkpoint", "open_checkpoint"]


class Checkpoint(Protocol):
    """What :func:`open_checkpoint` returns and the consolidation jobs use, whatever the format: a grid of
    shard files (:class:`~.grid.CheckpointLayout`: the own layout, Megatron-LM legacy) or a checkpoint
    of global tensors (:class:`~.dcp.DcpCheckpoint`, read by one process).

    A new format is one class with these members, and one branch in :func:`open_checkpoint`.
    """

    @property
    def kind(self) -> str:
        """``"own"``, ``"megatron_legacy"``, ``"megatron_torch_dist"`` or ``"dcp"`` (the report's layout)."""
        ...

    @property
    def tp(self) -> int:
        """Tensor-parallel size (1 for global tensors)."""
        ...

    @property
    def pp(self) -> int:
        """Pipeline-parallel size (1 for global tensors)."""
        ...

    @property
    def stages(self) -> int:
        """Rows of shard files: ``pp * ep``."""
        ...

    @property
    def rank_grid(self) -> MeshLayout:
        """The ranks of a consolidation, one per shard: axes ``("stage", "tp")``, TP fastest."""
        ...

    def describe_grid(self) -> str:
        """``TP 2 x PP 2``, or what the checkpoint is (for messages)."""
        ...

    def describe_stage(self, stage: int) -> str:
        """``stage p`` (for messages)."""
        ...

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding one stage's TP shards, in TP order."""
        ...

    def plan(self, rules: RuleChoice | None = None) -> list[MergePlanEntry]:
        """One entry per output tensor, from metadata alone; ``rules`` apply where shards are merged."""
        ...

    def left_out(self) -> list[tuple[str, str]]:
        """``(name, why)`` of what the checkpoint holds that no output tensor comes from (training state,
        optimizer, values that are not tensors): listed in the report, never dropped without a word."""
        ...

    def where(self, message: str) -> str:
        """What to append to an error ``message`` that names a tensor ('tensor 'NAME' ...'): the files and
        ranks holding its shards, `` (stage p: TP rank t = global rank r in 'file', ...)``; '' if none."""
        ...

    def check_ranks(self, world: int, name: str | os.PathLike[str]) -> None:
        """Raises ValueError (naming the checkpoint as ``name``) unless ``world`` ranks, one per shard file,
        can consolidate it."""
        ...

    def open_shard(self, tp_rank: int, stage: int, batch_bytes: int) -> ShardReader:
        """The reader of one shard's tensors, batch by batch (see :mod:`.reading`)."""
        ...

    def stream(self, writer: CheckpointWriter, entries: Sequence[MergePlanEntry]) -> bool:
        """Writes ``entries`` straight into ``writer`` where this checkpoint can without building the
        tensors (True), else does nothing (False: read them with :meth:`open_shard`)."""
        ...


def open_checkpoint(
    path: str | os.PathLike[str],
    layers_per_stage: Sequence[int] | None = None,
    iteration: int | str | None = None,
    *,
    names: str | None = None,
) -> Checkpoint:
    """Opens a sharded checkpoint, recognising its format (see the module docstring).

    Args:
        path: the checkpoint directory.
        layers_per_stage: grid layouts only: overrides the layer count per PP stage.
        iteration: Megatron only: open this iteration (or ``"release"``) instead of the tracked one.
        names: Megatron torch_dist only: ``"te"`` or ``"local"`` layer-norm names (see :mod:`.dcp`).

    Raises:
        FileNotFoundError: the directory or a shard file is missing (path named).
        LayoutError: no known format (the message says what was looked for) or an inconsistent one.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory '{root}' does not exist")
    mesh = root / MESH_FILE
    if mesh.is_file():
        try:
            description = json.loads(mesh.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise LayoutError(f"{mesh}: not valid JSON ({exc})") from None
        if not isinstance(description, dict):
            raise LayoutError(f"{mesh}: expected a JSON object")
        if layers_per_stage is not None:
            description["layers_per_stage"] = list(layers_per_stage)
        layout = OwnLayout(root, description)
        layout.check_files()
        return layout
    if (root / DCP_METADATA).is_file() and iteration is None:
        return _open_dcp(root, layers_per_stage, names)
    mroot = find_megatron_root(root, iteration)
    if mroot is not None:
        if (mroot / DCP_METADATA).is_file():
            return _open_dcp(mroot, layers_per_stage, names)
        return open_megatron_legacy(mroot, layers_per_stage)
    raise LayoutError(
        f"'{root}' is not a known checkpoint layout: looked for {MESH_FILE} (distribute_utils layout), "
        f"{DCP_METADATA} (torch.distributed.checkpoint; Megatron/NeMo torch_dist), "
        f"mp_rank_TT[_PPP][_EEE]/{MEGATRON_FILE} directories, {TRACKER_FILE} and iter_NNNNNNN "
        "directories (Megatron-LM)"
    )


def _open_dcp(root: Path, layers_per_stage: Sequence[int] | None, names: str | None) -> DcpCheckpoint:
    if layers_per_stage is not None:
        raise LayoutError(
            f"{root}: layers_per_stage does not apply to a torch.distributed.checkpoint directory "
            "(its metadata holds every tensor's global shape)"
        )
    return DcpCheckpoint(root, names)
