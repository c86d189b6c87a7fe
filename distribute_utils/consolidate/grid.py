"""Internal. Sharded checkpoints as a grid of files: the interface every grid format implements.

:class:`CheckpointLayout` says where each (TP rank, stage) shard lives and how its local names map to
global ones; formats are subclasses (:class:`~.own_layout.OwnLayout`, Megatron-LM legacy in
:mod:`.megatron`), opened by :func:`~.formats.open_checkpoint`. Also here: what writers of grids share (for
tests, demos and benchmarks).

Pipeline stages number their decoder layers locally from 0; :meth:`CheckpointLayout.global_name` turns the
first ``layers.<i>.`` component of a name into ``layers.<offset + i>.``, where ``offset`` is the sum of the
layer counts of the earlier stages (``layers_per_stage``; uneven splits are fine).
"""

from __future__ import annotations

import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import ArgumentError, LayoutError, MergeError, OutOfRangeError
from ..mesh_layout import MeshLayout
from ..temporaries import write_atomically
from .merge_plan import MergePlanEntry, plan_merge
from .reading import MappedShard
from .safetensors_read import read_safetensors_specs
from .specs import TensorSpec
from .writer_base import CheckpointWriter

if TYPE_CHECKING:
    from .rule_table import RuleChoice

__all__ = [
    "CheckpointLayout",
    "atomic_torch_save",
    "atomic_write_text",
    "flatten_tensors",
    "global_layer_name",
    "grid_of",
    "local_layer_index",
]

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"(?<![^.])layers\.(\d+)\.")
_TENSOR_IN_MESSAGE = re.compile(r"tensor '([^']+)'")


def local_layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def global_layer_name(name: str, offset: int) -> str:
    """Adds ``offset`` to the first ``layers.<i>.`` index of a name (``layers`` at the start or after a dot)."""
    if offset == 0:
        return name
    return _LAYER_RE.sub(lambda m: f"layers.{int(m.group(1)) + offset}.", name, count=1)


def flatten_tensors(tree: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, torch.Tensor], list[str]]:
    """Nested dicts of tensors as one ``{dotted name: tensor}`` dict, and the names of non-tensor leaves.

    ``None`` leaves (Megatron's empty ``_extra_state``) are dropped without a word; ``*._extra_state``
    entries (TransformerEngine's FP8 metadata, not weights) are listed with the other non-tensor leaves.
    """
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    stack = [(prefix, tree)]
    while stack:
        base, node = stack.pop(0)
        for key, value in node.items():
            name = f"{base}{key}"
            if name.endswith("._extra_state") or name == "_extra_state":
                if value is not None:
                    skipped.append(name)
            elif isinstance(value, torch.Tensor):
                out[name] = value
            elif isinstance(value, Mapping):
                stack.append((name + ".", value))
            elif value is not None:
                skipped.append(name)
    return out, skipped


# --------------------------------------------------------------------------------------------------------
# The common interface.


class CheckpointLayout(ABC):
    """A sharded checkpoint on disk, as a grid of files: ``stages`` rows of ``tp`` files each.

    A row (a *stage*) holds the TP shards of one pipeline stage and, for mixture-of-experts models, one
    expert-parallel rank: stage ``s`` is ``(pp_rank, ep_rank) = divmod(s, ep)``. Stage-local names are
    renumbered to global ones by :meth:`global_name` (decoder layers by the layer counts of the earlier
    stages; experts by the EP rank); :meth:`is_replica` marks what a stage holds only as a copy of
    another stage's tensor (a tied output layer, an EP rank's copy of the dense weights).

    Attributes:
        root: the directory holding the shards.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        ep: expert-parallel size (1 for dense models).
        file_format: ``"safetensors"`` or ``"torch"``.
        gated_mlp: whether ``linear_fc1`` holds ``[gate; up]`` (SwiGLU); ``None`` when the checkpoint
            does not say.
    """

    kind: ClassVar[str] = ""

    def __init__(
        self,
        root: Path,
        tp: int,
        pp: int,
        file_format: str,
        layers_per_stage: Sequence[int] | None = None,
        ep: int = 1,
        gated_mlp: bool | None = False,
    ) -> None:
        self.root = root
        self.tp = tp
        self.pp = pp
        self.ep = ep
        self.file_format = file_format
        self.gated_mlp = gated_mlp
        self._counts: dict[tuple[int, int], int] | None = None
        if layers_per_stage is not None:
            lps = tuple(int(n) for n in layers_per_stage)
            if len(lps) != pp or any(n < 0 for n in lps):
                raise LayoutError(
                    f"{root}: layers_per_stage {list(lps)} must have {pp} non-negative entries (one per stage)"
                )
            self._counts = {(p, 0): n for p, n in enumerate(lps)}
        self._given_layers = list(layers_per_stage) if layers_per_stage is not None else None
        self._specs: dict[tuple[int, int], list[TensorSpec]] = {}

    def __repr__(self) -> str:
        grid = f"tp={self.tp}, pp={self.pp}" + (f", ep={self.ep}" if self.ep > 1 else "")
        return f"{type(self).__name__}('{self.root}', {grid}, format={self.file_format})"

    @property
    def stages(self) -> int:
        """Rows of the grid: ``pp * ep``."""
        return self.pp * self.ep

    @property
    def rank_grid(self) -> MeshLayout:
        """The ranks of a consolidation of this checkpoint, one per file: axes ``("stage", "tp")``, TP
        fastest (as Megatron numbers ranks); rank ``(s, t)`` reads ``file_for(t, s)``."""
        return MeshLayout((self.stages, self.tp), axis_names=("stage", "tp"))

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding one stage's TP shards, in TP order."""
        return self.rank_grid.groups_along("tp")[stage]

    def stage_coords(self, stage: int) -> tuple[int, int]:
        """``(pp_rank, ep_rank)`` of a stage."""
        return divmod(stage, self.ep)

    def describe_stage(self, stage: int) -> str:
        """``stage p``, or ``stage p, EP rank e`` for expert-parallel checkpoints (for messages)."""
        p, e = self.stage_coords(stage)
        return f"stage {p}" if self.ep == 1 else f"stage {p}, EP rank {e}"

    def describe_grid(self) -> str:
        """``TP 2 x PP 2`` (with ``x EP e`` when expert-parallel)."""
        return f"TP {self.tp} x PP {self.pp}" + (f" x EP {self.ep}" if self.ep > 1 else "")

    @abstractmethod
    def file_for(self, tp_rank: int, stage: int) -> Path:
        """The file holding the shard of ``(tp_rank, stage)``."""

    @abstractmethod
    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        """Loads one shard file as a flat dict with local names."""

    def _check_coords(self, tp_rank: int, stage: int) -> None:
        if not (0 <= tp_rank < self.tp and 0 <= stage < self.stages):
            raise OutOfRangeError(
                f"shard (tp={tp_rank}, stage={stage}) is outside {self.describe_grid()}; valid: tp in "
                f"0..{self.tp - 1}, stage in 0..{self.stages - 1}"
            )

    def shards(self) -> Iterator[tuple[int, int]]:
        """All ``(tp_rank, stage)`` pairs, stage by stage."""
        for s in range(self.stages):
            for t in range(self.tp):
                yield t, s

    def check_files(self) -> None:
        """Raises FileNotFoundError naming the first missing shard file."""
        for t, s in self.shards():
            path = self.file_for(t, s)
            if not path.is_file():
                raise FileNotFoundError(
                    f"checkpoint shard (TP rank {t}, {self.describe_stage(s)}) is missing: '{path}' does not exist"
                )

    def load_shard(self, tp_rank: int, stage: int) -> dict[str, torch.Tensor]:
        """Loads one shard with local names; memory-mapped where the format allows.

        Raises:
            FileNotFoundError: the shard file is missing (path named).
        """
        self._check_coords(tp_rank, stage)
        path = self.file_for(tp_rank, stage)
        if not path.is_file():
            raise FileNotFoundError(
                f"checkpoint shard (TP rank {tp_rank}, {self.describe_stage(stage)}) is missing: '{path}'"
            )
        return self._load(path)

    def shard_specs(self, tp_rank: int, stage: int) -> list[TensorSpec]:
        """Names (local), dtypes and shapes of one shard, in file order; reads metadata only where possible."""
        key = (tp_rank, stage)
        if key not in self._specs:
            self._check_coords(tp_rank, stage)
            path = self.file_for(tp_rank, stage)
            if not path.is_file():
                raise FileNotFoundError(
                    f"checkpoint shard (TP rank {tp_rank}, {self.describe_stage(stage)}) is missing: '{path}'"
                )
            if self.file_format == "safetensors":
                self._specs[key] = read_safetensors_specs(path)
            else:
                self._specs[key] = [TensorSpec.of(n, t) for n, t in self._load(path).items()]
        return list(self._specs[key])

    def split_chunk(self, local: str) -> tuple[int, str]:
        """``(virtual pipeline chunk, name inside it)`` of a local name; chunk 0 unless the layout has chunks."""
        return 0, local

    def _layer_counts(self) -> dict[tuple[int, int], int]:
        """Decoder layers per ``(pp_rank, chunk)``: given, else counted from the names on TP rank 0."""
        if self._counts is None:
            counts: dict[tuple[int, int], int] = {}
            for p in range(self.pp):
                per_chunk: dict[int, set[int]] = {}
                for spec in self.shard_specs(0, p * self.ep):
                    chunk, rest = self.split_chunk(spec.name)
                    indices = per_chunk.setdefault(chunk, set())
                    if (i := local_layer_index(rest)) is not None:
                        indices.add(i)
                for chunk, indices in per_chunk.items():
                    if indices != set(range(len(indices))):
                        raise LayoutError(
                            f"{self.root}: stage {p} has layer indices {sorted(indices)}, not 0..n-1; "
                            "give layers_per_stage explicitly"
                        )
                    counts[(p, chunk)] = len(indices)
            self._counts = counts
        return self._counts

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """Decoder layers on each pipeline stage (all its virtual chunks together)."""
        counts = self._layer_counts()
        return tuple(sum(n for (p, _), n in counts.items() if p == stage) for stage in range(self.pp))

    def _layer_offset(self, pp_rank: int, chunk: int) -> int:
        """Global index of the first layer of ``(pp_rank, chunk)``: chunk-major order, as Megatron interleaves."""
        order = chunk * self.pp + pp_rank
        return sum(n for (p, c), n in self._layer_counts().items() if c * self.pp + p < order)

    def stage_offset(self, pp_rank: int) -> int:
        """Global index of the first layer of a stage (without virtual chunks)."""
        return self._layer_offset(pp_rank, 0)

    def _global_expert_name(self, name: str, stage: int) -> str:
        """Renumbers a stage's local experts to global ones; identity without expert parallelism."""
        return name

    def is_replica(self, local: str, stage: int) -> bool:
        """Whether a stage holds this tensor only as a copy of another stage's (left out of the output)."""
        return False

    def global_name(self, name: str, stage: int) -> str:
        """Renumbers a stage-local name to its global name (layers, then experts).

        Raises:
            LayoutError: the local layer index is beyond that stage's layer count.
        """
        chunk, rest = self.split_chunk(name)
        p, _ = self.stage_coords(stage)
        local = local_layer_index(rest)
        if local is not None:
            count = self._layer_counts().get((p, chunk), 0)
            if local >= count:
                raise LayoutError(
                    f"tensor '{name}' on stage {p} has layer index {local}, "
                    f"but that stage has {count} layers (layers_per_stage={list(self.layers_per_stage)})"
                )
            rest = global_layer_name(rest, self._layer_offset(p, chunk))
        return self._global_expert_name(rest, stage)

    # -- what a consolidation asks of a checkpoint (:class:`~.formats.Checkpoint`) -------------------------
    def plan(self, rules: RuleChoice | None = None) -> list[MergePlanEntry]:
        """:func:`plan_merge` with the rules asked for (for this MLP); a merge error names, per TP rank of
        the tensor's stage, its global rank and shard file."""
        try:
            return plan_merge(self, rules.table(self.gated_mlp) if rules is not None else None)
        except MergeError as exc:
            raise MergeError(f"{exc}{self.where(str(exc))}") from None

    def left_out(self) -> list[tuple[str, str]]:
        """``(name, why)`` of what the shard files hold besides the model's tensors (none here; a format
        with training state in its files says what it leaves out)."""
        return []

    def where(self, message: str) -> str:
        """`` (stage p: TP rank t = global rank r in 'file', ...)`` for the tensor a message names ('' when
        it names none), to append to the message."""
        m = _TENSOR_IN_MESSAGE.search(message)
        if m is None:
            return ""
        try:
            for s in range(self.stages):
                for spec in self.shard_specs(0, s):
                    if self.global_name(spec.name, s) == m.group(1):
                        shards = ", ".join(
                            f"TP rank {t} = global rank {r} in '{self.file_for(t, s)}'"
                            for t, r in enumerate(self.stage_ranks(s))
                        )
                        return f" ({self.describe_stage(s)}: {shards})"
        except Exception:  # only decoration of an error message
            logger.debug("could not locate tensor %r", m.group(1), exc_info=True)
        return ""

    def check_ranks(self, world: int, name: str | os.PathLike[str]) -> None:
        """Raises ValueError unless ``world`` is one rank per shard file."""
        needed = self.tp * self.stages
        if world != needed:
            raise ArgumentError(
                f"'{name}' is a {self.describe_grid()} checkpoint and needs {needed} ranks, but the world "
                f"has {world}; run it on {needed} ranks (or on 1 to consolidate in one process)"
            )

    def open_shard(self, tp_rank: int, stage: int, batch_bytes: int) -> MappedShard:
        """The shard file, memory-mapped and remapped about every ``batch_bytes`` (:mod:`.reading`)."""
        return MappedShard(self, tp_rank, stage, batch_bytes)

    def stream(self, writer: CheckpointWriter, entries: Sequence[MergePlanEntry]) -> bool:
        """Shards are merged by rules, never streamed: False."""
        return False


# --------------------------------------------------------------------------------------------------------
# Writing layouts (for tests, demos and benchmarks).


def grid_of(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]]) -> tuple[int, int]:
    if not shards:
        raise ArgumentError("no shards given; give {(tp_rank, pp_rank): state_dict} for a full grid")
    tp = max(t for t, _ in shards) + 1
    pp = max(p for _, p in shards) + 1
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in shards]
    if missing:
        raise ArgumentError(f"shards must cover a full tp={tp} x pp={pp} grid; missing (tp, pp) {missing}")
    return tp, pp


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` by temporary name, fsync, rename (for tests, demos and benchmarks); a temporary left by a
    killed process is removed by ``distribute-utils clean`` (:func:`~distribute_utils.temporaries.write_atomically`)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(fd: int) -> None:
        with open(fd, "wb", closefd=False) as f:
            torch.save(obj, f)

    write_atomically(path, save)


def atomic_write_text(path: Path, text: str) -> None:
    """Writes a text file by temporary name, fsync, rename (see :func:`atomic_torch_save`)."""

    def put(fd: int) -> None:
        with open(fd, "w", encoding="utf-8", closefd=False) as f:
            f.write(text)

    write_atomically(path, put)
