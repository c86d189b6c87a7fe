"""Sharded checkpoints as a grid of files: the common interface, the own layout, and merge planning.

* :class:`CheckpointLayout`: where each (TP rank, stage) shard lives and how its local names map to global
  ones; formats are subclasses (the own layout here, Megatron-LM legacy in :mod:`.megatron`), opened by
  :func:`~.formats.open_checkpoint`;
* :class:`OwnLayout`: a directory with ``mesh.json`` and one file per rank;
* :func:`plan_merge`: the consolidation plan from metadata alone.

Pipeline stages number their decoder layers locally from 0; :meth:`CheckpointLayout.global_name` turns the
first ``layers.<i>.`` component of a name into ``layers.<offset + i>.``, where ``offset`` is the sum of the
layer counts of the earlier stages (``layers_per_stage``; uneven splits are fine).
"""

from __future__ import annotations

import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import ArgumentError, LayoutError, OutOfRangeError
from ..mesh_layout import MeshLayout
from ..temporaries import write_atomically
from .reading import MappedShard
from .rules import MergeError, MergeRule, RuleTable
from .safe_load import safe_torch_load
from .writers import (
    CheckpointWriter,
    SafetensorsWriter,
    TensorSpec,
    load_safetensors,
    read_safetensors_specs,
    standalone,
)

if TYPE_CHECKING:
    from .plan import RuleChoice

__all__ = [
    "MESH_FILE",
    "CheckpointLayout",
    "LayoutError",
    "MergePlanEntry",
    "OwnLayout",
    "flatten_tensors",
    "global_layer_name",
    "local_layer_index",
    "plan_merge",
    "write_own_layout",
]

logger = logging.getLogger(__name__)

#: Name of the own layout's description file.
MESH_FILE = "mesh.json"
_FILE_FORMATS = ("safetensors", "torch")
_DEFAULT_FILES = {"safetensors": "rank_{rank:05d}.safetensors", "torch": "rank_{rank:05d}.pt"}
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


def _flat_state_dict(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, Mapping):
        raise LayoutError(f"'{path}': expected a dict of tensors, got {type(obj).__name__}")
    out, skipped = flatten_tensors(obj)
    if skipped:
        raise LayoutError(
            f"'{path}' holds entries that are not tensors ({', '.join(skipped[:5])}); a shard file of this "
            "layout must hold only tensors"
        )
    return out


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
            raise MergeError(f"{exc}{self._where(str(exc))}") from None

    def _where(self, message: str) -> str:
        """`` (stage p: TP rank t = global rank r in 'file', ...)`` for the tensor a message names."""
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


class OwnLayout(CheckpointLayout):
    """The project's own layout: ``mesh.json`` plus one file per rank.

    ``mesh.json`` (all keys but ``format_version`` and ``shape`` optional)::

        {
          "format_version": 1,
          "shape": [2, 4],                 # sizes of the axes, in axis_names order
          "axis_names": ["pp", "tp"],      # a permutation of "pp" and "tp" (default ["pp", "tp"]);
                                           # an axis left out has size 1
          "file_format": "safetensors",    # or "torch" (torch.save of a flat {name: tensor} dict)
          "files": "rank_{rank:05d}.safetensors",  # str.format template: {rank}, {tp}, {pp}
          "layers_per_stage": [3, 1]       # decoder layers per PP stage; inferred from names when absent
        }

    ``rank`` is the row-major index of ``(coordinate per axis)`` over ``shape`` in ``axis_names`` order: with
    ``["pp", "tp"]``, ``rank = pp_rank * tp + tp_rank`` (TP fastest, as Megatron numbers ranks).
    """

    kind = "own"

    def __init__(self, root: Path, description: Mapping[str, Any]) -> None:
        """Validates a parsed ``mesh.json``; see the class docstring for the keys."""
        src = root / MESH_FILE
        d = dict(description)
        version = d.get("format_version")
        if version != 1:
            raise LayoutError(f"{src}: format_version must be 1, got {version!r}")
        unknown = set(d) - {
            "format_version",
            "shape",
            "axis_names",
            "file_format",
            "files",
            "layers_per_stage",
        }
        if unknown:
            raise LayoutError(f"{src}: unknown keys {sorted(unknown)}")
        axes = d.get("axis_names", ["pp", "tp"])
        shape = d.get("shape")
        if (
            not isinstance(axes, list)
            or not axes
            or len(set(axes)) != len(axes)
            or not set(axes) <= {"pp", "tp"}
        ):
            raise LayoutError(f"{src}: axis_names must be distinct names from ['pp', 'tp'], got {axes!r}")
        if (
            not isinstance(shape, list)
            or len(shape) != len(axes)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)
        ):
            raise LayoutError(f"{src}: shape must list one positive size per axis {axes}, got {shape!r}")
        file_format = d.get("file_format", "safetensors")
        if file_format not in _FILE_FORMATS:
            raise LayoutError(f"{src}: file_format must be one of {list(_FILE_FORMATS)}, got {file_format!r}")
        self.axis_names: tuple[str, ...] = tuple(axes)
        self.shape: tuple[int, ...] = tuple(shape)
        sizes = dict(zip(axes, shape))
        self.files: str = d.get("files", _DEFAULT_FILES[file_format])
        if not isinstance(self.files, str) or not self.files:
            raise LayoutError(f"{src}: files must be a non-empty str.format template, got {self.files!r}")
        layers = d.get("layers_per_stage")
        if layers is not None and (
            not isinstance(layers, list)
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in layers)
        ):
            raise LayoutError(f"{src}: layers_per_stage must be a list of ints, got {layers!r}")
        try:
            super().__init__(root, sizes.get("tp", 1), sizes.get("pp", 1), file_format, layers)
        except LayoutError as exc:
            raise LayoutError(f"{src}: {exc}") from None
        try:
            sample = self._filename(0, 0)
        except (KeyError, IndexError, ValueError) as exc:
            raise LayoutError(
                f"{src}: bad files template {self.files!r} ({exc!r}); it may use {{rank}}, {{tp}}, {{pp}}"
            ) from None
        if Path(sample).is_absolute() or ".." in Path(sample).parts:
            raise LayoutError(
                f"{src}: files template {self.files!r} must give relative paths inside the directory"
            )
        names = {self._filename(t, p) for t, p in self.shards()}
        if len(names) != self.tp * self.pp:
            raise LayoutError(
                f"{src}: files template {self.files!r} gives the same file name to several ranks"
            )

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        """Row-major rank of a shard over ``shape`` in ``axis_names`` order."""
        coords = {"tp": tp_rank, "pp": pp_rank}
        rank = 0
        for axis, size in zip(self.axis_names, self.shape):
            rank = rank * size + coords[axis]
        return rank

    def _filename(self, tp_rank: int, pp_rank: int) -> str:
        return self.files.format(rank=self.rank_of(tp_rank, pp_rank), tp=tp_rank, pp=pp_rank)

    def file_for(self, tp_rank: int, pp_rank: int) -> Path:
        """The file of one shard (``files`` template under the root)."""
        self._check_coords(tp_rank, pp_rank)
        return self.root / self._filename(tp_rank, pp_rank)

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        if self.file_format == "safetensors":
            return load_safetensors(path, mmap=True)
        return _flat_state_dict(safe_torch_load(path), path)

    def describe(self) -> dict[str, Any]:
        """The ``mesh.json`` contents for this layout."""
        d: dict[str, Any] = {
            "format_version": 1,
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "file_format": self.file_format,
            "files": self.files,
        }
        if self._given_layers is not None:
            d["layers_per_stage"] = list(self._given_layers)
        return d


# --------------------------------------------------------------------------------------------------------
# Planning from metadata.


@dataclass(frozen=True)
class MergePlanEntry:
    """One output tensor: where its shards are and how to merge them.

    Attributes:
        name: global (renumbered) name in the output.
        pp_rank: the stage (grid row, see :class:`CheckpointLayout`) holding it.
        local_name: its name inside that stage's shard files.
        rule: the merge rule over the stage's TP shards.
        spec: the merged tensor's spec (``spec.name == name``).
    """

    name: str
    pp_rank: int
    local_name: str
    rule: MergeRule
    spec: TensorSpec


def plan_merge(layout: CheckpointLayout, rules: RuleTable | None = None) -> list[MergePlanEntry]:
    """Plans a consolidation from metadata alone, stage by stage, in file order.

    Checks that every TP rank of a stage holds the same names, that the rule accepts their dtypes and
    shapes, and that no global name comes from two stages. What a stage holds as a replica of another
    stage's tensor (:meth:`CheckpointLayout.is_replica`) is left out.

    Args:
        layout: the opened checkpoint.
        rules: merge rules; ``RuleTable.default()`` for the layout's MLP kind when ``None``.

    Raises:
        LayoutError: names differ between TP ranks, or a name appears on two stages.
        MergeError: a rule rejects the shards' shapes or dtypes, or no rule is known for a split tensor.
    """
    table = rules if rules is not None else RuleTable.default(gated=layout.gated_mlp)
    plan: list[MergePlanEntry] = []
    seen: dict[str, int] = {}
    ranks_tp = list(range(layout.tp))
    for s in range(layout.stages):
        per_rank = [{spec.name: spec for spec in layout.shard_specs(t, s)} for t in ranks_tp]
        names = list(per_rank[0])
        for t in ranks_tp[1:]:
            if set(per_rank[t]) != set(names):
                missing = sorted(set(names) - set(per_rank[t]))[:5]
                extra = sorted(set(per_rank[t]) - set(names))[:5]
                raise LayoutError(
                    f"{layout.describe_stage(s)}: TP rank {t} holds different tensors than TP rank 0 "
                    f"(missing {missing}, extra {extra}) in '{layout.file_for(t, s)}'"
                )
        for local in names:
            if layout.is_replica(local, s):
                continue
            name = layout.global_name(local, s)
            if name in seen:
                raise LayoutError(
                    f"tensor '{name}' comes from {layout.describe_stage(seen[name])} and "
                    f"{layout.describe_stage(s)}; check layers_per_stage (or, for tied embeddings, the "
                    "checkpoint's untie_embeddings_and_output_weights)"
                )
            seen[name] = s
            rule = table.rule_for(name)
            spec = rule.merged_spec(name, [per_rank[t][local] for t in ranks_tp], ranks_tp)
            plan.append(MergePlanEntry(name, s, local, rule, spec))
    return plan


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


def write_own_layout(
    directory: str | os.PathLike[str],
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
    file_format: str = "safetensors",
    layers_per_stage: Sequence[int] | None = None,
    files: str | None = None,
    axis_names: Sequence[str] = ("pp", "tp"),
) -> OwnLayout:
    """Writes shards in the own layout (files first, ``mesh.json`` last).

    Args:
        directory: output directory (created).
        shards: ``{(tp_rank, pp_rank): {local_name: tensor}}`` covering a full grid.
        file_format: ``"safetensors"`` or ``"torch"``.
        layers_per_stage: recorded in ``mesh.json`` when given.
        files: file name template (``{rank}``, ``{tp}``, ``{pp}``); safetensors names must end in
            ``.safetensors``. Default ``rank_{rank:05d}.safetensors`` / ``.pt``.
        axis_names: order of the axes in ``shape`` and in the rank numbering.

    Returns:
        The layout, as :func:`open_checkpoint` would open it.
    """
    if file_format not in _FILE_FORMATS:
        raise ArgumentError(f"unknown file_format {file_format!r}; valid: {', '.join(_FILE_FORMATS)}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tp, pp = grid_of(shards)
    sizes = {"tp": tp, "pp": pp}
    description: dict[str, Any] = {
        "format_version": 1,
        "shape": [sizes[a] for a in axis_names],
        "axis_names": list(axis_names),
        "file_format": file_format,
        "files": files or _DEFAULT_FILES[file_format],
    }
    if layers_per_stage is not None:
        description["layers_per_stage"] = list(layers_per_stage)
    layout = OwnLayout(root, description)
    for (t, p), sd in shards.items():
        path = layout.file_for(t, p)
        path.parent.mkdir(parents=True, exist_ok=True)
        if file_format == "safetensors":
            if not path.name.endswith(".safetensors"):
                raise ArgumentError(f"safetensors shard names must end in .safetensors, got '{path.name}'")
            with SafetensorsWriter(path, [TensorSpec.of(n, x) for n, x in sd.items()]) as w:
                for n, x in sd.items():
                    w.write(n, x)
        else:
            atomic_torch_save({n: standalone(x) for n, x in sd.items()}, path)
    atomic_write_text(root / MESH_FILE, json.dumps(description, indent=2) + "\n")
    return layout
