"""Input checkpoint layouts: where each (TP rank, PP rank) shard lives and how its names map to global ones.

Two layouts are understood, behind one interface (:class:`CheckpointLayout`, opened with
:func:`open_checkpoint`):

* **own** (:class:`OwnLayout`): a directory with ``mesh.json`` and one file per rank;
* **Megatron-LM legacy** (:class:`MegatronLegacyLayout`): ``mp_rank_XX[_YYY]/model_optim_rng.pt``,
  optionally under ``iter_NNNNNNN/`` with ``latest_checkpointed_iteration.txt`` beside it.

Pipeline stages number their decoder layers locally from 0; :meth:`CheckpointLayout.global_name` turns the
first ``layers.<i>.`` component of a name into ``layers.<offset + i>.``, where ``offset`` is the sum of the
layer counts of the earlier stages (``layers_per_stage``; uneven splits are fine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..errors import DistributeError
from .rules import MergeRule, RuleTable
from .writers import SafetensorsWriter, TensorSpec, _standalone, load_safetensors, read_safetensors_specs

__all__ = [
    "MEGATRON_FILE",
    "MESH_FILE",
    "CheckpointLayout",
    "LayoutError",
    "MegatronLegacyLayout",
    "MergePlanEntry",
    "OwnLayout",
    "global_layer_name",
    "open_checkpoint",
    "plan_merge",
    "safe_torch_load",
    "write_megatron_legacy",
    "write_own_layout",
]

logger = logging.getLogger(__name__)

#: Name of the own layout's description file.
MESH_FILE = "mesh.json"
#: File name inside each Megatron ``mp_rank_*`` directory.
MEGATRON_FILE = "model_optim_rng.pt"
_TRACKER = "latest_checkpointed_iteration.txt"
_FILE_FORMATS = ("safetensors", "torch")
_DEFAULT_FILES = {"safetensors": "rank_{rank:05d}.safetensors", "torch": "rank_{rank:05d}.pt"}
_LAYER_RE = re.compile(r"(?<![^.])layers\.(\d+)\.")
_MP_RE = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
_ITER_RE = re.compile(r"iter_(\d{7})")


class LayoutError(DistributeError, ValueError):
    """A checkpoint directory is not a known layout, or its description is inconsistent."""


def _local_layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def global_layer_name(name: str, offset: int) -> str:
    """Adds ``offset`` to the first ``layers.<i>.`` index of a name (``layers`` at the start or after a dot)."""
    if offset == 0:
        return name
    return _LAYER_RE.sub(lambda m: f"layers.{int(m.group(1)) + offset}.", name, count=1)


# --------------------------------------------------------------------------------------------------------
# Safe torch.load.


def _safe_globals() -> list[Any]:
    """Harmless non-tensor types found in real Megatron checkpoints (``args``, numpy RNG states)."""
    allowed: list[Any] = [argparse.Namespace]
    try:
        import numpy as np

        core = getattr(np, "_core", None) or np.core
        allowed += [core.multiarray._reconstruct, np.ndarray, np.dtype]
        allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.uint8)]
    except Exception:  # pragma: no cover - numpy is optional
        pass
    return allowed


def safe_torch_load(path: str | os.PathLike[str]) -> Any:
    """``torch.load(weights_only=True, mmap=True, map_location="cpu")`` with a clear error for pickled objects.

    Only tensors, containers, plain scalars, ``argparse.Namespace`` and numpy arrays are accepted; files
    holding other objects are refused, never unpickled. Files in the pre-1.6 (non-zip) format cannot be
    mapped and are read into memory instead.

    Raises:
        FileNotFoundError: no such file.
        LayoutError: the file holds objects that cannot be loaded safely (named in the message).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint shard '{p}' does not exist")
    try:
        allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
        with allow(_safe_globals()) if allow is not None else contextlib.nullcontext():
            try:
                return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        try:
            unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(p)) or "unknown"
        except Exception:
            unsafe = "unknown"
        raise LayoutError(
            f"'{p}' holds non-tensor Python objects ({unsafe}) that cannot be loaded with weights_only=True; "
            "distribute_utils never unpickles arbitrary objects. In a trusted environment, re-save just the "
            "tensors, e.g. torch.save({'model': torch.load(path, weights_only=False)['model']}, path)"
        ) from None


def _flatten(tree: Mapping[str, Any], prefix: str, out: dict[str, torch.Tensor], skipped: list[str]) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, Mapping):
            _flatten(value, name + ".", out, skipped)
        elif value is not None:
            skipped.append(name)


def _flat_state_dict(obj: Any, path: Path, key: str | None) -> dict[str, torch.Tensor]:
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            found = sorted(obj)[:10] if isinstance(obj, Mapping) else type(obj).__name__
            hint = (
                " (virtual pipeline checkpoints with model0, model1, ... are not supported)"
                if (isinstance(obj, Mapping) and "model0" in obj)
                else ""
            )
            raise LayoutError(f"'{path}' has no '{key}' entry; found {found}{hint}")
        obj = obj[key]
    if not isinstance(obj, Mapping):
        raise LayoutError(f"'{path}': expected a dict of tensors, got {type(obj).__name__}")
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    _flatten(obj, "", out, skipped)
    if skipped:
        logger.debug("%s: ignored %d non-tensor entries: %s", path, len(skipped), skipped[:10])
    return out


# --------------------------------------------------------------------------------------------------------
# The common interface.


class CheckpointLayout(ABC):
    """A TP x PP sharded checkpoint on disk.

    Attributes:
        root: the directory holding the shards.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        file_format: ``"safetensors"`` or ``"torch"``.
    """

    kind: ClassVar[str] = ""

    def __init__(
        self, root: Path, tp: int, pp: int, file_format: str, layers_per_stage: Sequence[int] | None = None
    ) -> None:
        self.root = root
        self.tp = tp
        self.pp = pp
        self.file_format = file_format
        if layers_per_stage is not None:
            lps = tuple(int(n) for n in layers_per_stage)
            if len(lps) != pp or any(n < 0 for n in lps):
                raise LayoutError(
                    f"{root}: layers_per_stage {list(lps)} must have {pp} non-negative entries (one per stage)"
                )
            self._layers: tuple[int, ...] | None = lps
        else:
            self._layers = None
        self._specs: dict[tuple[int, int], list[TensorSpec]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}('{self.root}', tp={self.tp}, pp={self.pp}, format={self.file_format})"

    @abstractmethod
    def file_for(self, tp_rank: int, pp_rank: int) -> Path:
        """The file holding the shard of ``(tp_rank, pp_rank)``."""

    @abstractmethod
    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        """Loads one shard file as a flat dict with local names."""

    def _check_coords(self, tp_rank: int, pp_rank: int) -> None:
        if not (0 <= tp_rank < self.tp and 0 <= pp_rank < self.pp):
            raise IndexError(f"shard (tp={tp_rank}, pp={pp_rank}) is outside tp={self.tp} x pp={self.pp}")

    def shards(self) -> Iterator[tuple[int, int]]:
        """All ``(tp_rank, pp_rank)`` pairs, stage by stage."""
        for p in range(self.pp):
            for t in range(self.tp):
                yield t, p

    def check_files(self) -> None:
        """Raises FileNotFoundError naming the first missing shard file."""
        for t, p in self.shards():
            path = self.file_for(t, p)
            if not path.is_file():
                raise FileNotFoundError(
                    f"checkpoint shard (tp={t}, pp={p}) is missing: '{path}' does not exist"
                )

    def load_shard(self, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        """Loads one shard with local names; memory-mapped where the format allows.

        Raises:
            FileNotFoundError: the shard file is missing (path named).
        """
        self._check_coords(tp_rank, pp_rank)
        path = self.file_for(tp_rank, pp_rank)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard (tp={tp_rank}, pp={pp_rank}) is missing: '{path}'")
        return self._load(path)

    def shard_specs(self, tp_rank: int, pp_rank: int) -> list[TensorSpec]:
        """Names (local), dtypes and shapes of one shard, in file order; reads metadata only where possible."""
        key = (tp_rank, pp_rank)
        if key not in self._specs:
            self._check_coords(tp_rank, pp_rank)
            path = self.file_for(tp_rank, pp_rank)
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint shard (tp={tp_rank}, pp={pp_rank}) is missing: '{path}'")
            if self.file_format == "safetensors":
                self._specs[key] = read_safetensors_specs(path)
            else:
                self._specs[key] = [TensorSpec.of(n, t) for n, t in self._load(path).items()]
        return list(self._specs[key])

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """Decoder layers on each stage: given by the layout, else counted from the names on TP rank 0."""
        if self._layers is None:
            counts = []
            for p in range(self.pp):
                indices = {i for s in self.shard_specs(0, p) if (i := _local_layer_index(s.name)) is not None}
                if indices != set(range(len(indices))):
                    raise LayoutError(
                        f"{self.root}: stage {p} has layer indices {sorted(indices)}, not 0..n-1; "
                        "give layers_per_stage explicitly"
                    )
                counts.append(len(indices))
            self._layers = tuple(counts)
        return self._layers

    def stage_offset(self, pp_rank: int) -> int:
        """Global index of the first layer of a stage."""
        return sum(self.layers_per_stage[:pp_rank])

    def global_name(self, name: str, pp_rank: int) -> str:
        """Renumbers a stage-local name to its global name.

        Raises:
            LayoutError: the local layer index is beyond that stage's layer count.
        """
        local = _local_layer_index(name)
        if local is None:
            return name
        count = self.layers_per_stage[pp_rank]
        if local >= count:
            raise LayoutError(
                f"tensor '{name}' on stage {pp_rank} has layer index {local}, "
                f"but that stage has {count} layers (layers_per_stage={list(self.layers_per_stage)})"
            )
        return global_layer_name(name, self.stage_offset(pp_rank))


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
        return _flat_state_dict(safe_torch_load(path), path, None)

    def describe(self) -> dict[str, Any]:
        """The ``mesh.json`` contents for this layout."""
        d: dict[str, Any] = {
            "format_version": 1,
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "file_format": self.file_format,
            "files": self.files,
        }
        if self._layers is not None:
            d["layers_per_stage"] = list(self._layers)
        return d


class MegatronLegacyLayout(CheckpointLayout):
    """Megatron-LM's legacy (non-distributed) checkpoint: ``mp_rank_XX[_YYY]/model_optim_rng.pt``.

    ``XX`` is the TP rank (2 digits), ``YYY`` the PP rank (3 digits, only when PP > 1). The state dict is the
    ``model`` entry of each file; nested dicts are flattened with ``.``; non-tensor leaves are ignored.
    """

    kind = "megatron_legacy"

    def __init__(
        self, root: Path, tp: int, pp: int, with_pp: bool, layers_per_stage: Sequence[int] | None = None
    ):
        """Use :func:`open_checkpoint`; ``root`` is the directory holding the ``mp_rank_*`` directories."""
        super().__init__(root, tp, pp, "torch", layers_per_stage)
        self.with_pp = with_pp

    def file_for(self, tp_rank: int, pp_rank: int) -> Path:
        """``root/mp_rank_XX[_YYY]/model_optim_rng.pt``."""
        self._check_coords(tp_rank, pp_rank)
        sub = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" if self.with_pp else f"mp_rank_{tp_rank:02d}"
        return self.root / sub / MEGATRON_FILE

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        return _flat_state_dict(safe_torch_load(path), path, "model")


def _megatron_root(path: Path, iteration: int | str | None) -> Path | None:
    """The directory holding ``mp_rank_*`` directories, or None when this is not a Megatron checkpoint."""
    if iteration is not None:
        sub = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
        if not (path / sub).is_dir():
            raise FileNotFoundError(f"Megatron checkpoint iteration directory '{path / sub}' does not exist")
        return path / sub
    if any(_MP_RE.fullmatch(p.name) for p in path.iterdir() if p.is_dir()):
        return path
    tracker = path / _TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            sub = "release"
        elif text.isdigit():
            sub = f"iter_{int(text):07d}"
        else:
            raise LayoutError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
        if not (path / sub).is_dir():
            raise FileNotFoundError(f"{tracker} names iteration {text}, but '{path / sub}' does not exist")
        return path / sub
    iters = sorted(p.name for p in path.iterdir() if p.is_dir() and _ITER_RE.fullmatch(p.name))
    if iters:
        logger.info("%s: no %s; using the latest iteration directory %s", path, _TRACKER, iters[-1])
        return path / iters[-1]
    return None


def _open_megatron(root: Path, layers_per_stage: Sequence[int] | None) -> MegatronLegacyLayout:
    found: dict[tuple[int, int], bool] = {}
    forms: set[bool] = set()
    for p in root.iterdir():
        m = _MP_RE.fullmatch(p.name)
        if m and p.is_dir():
            forms.add(m.group(2) is not None)
            found[(int(m.group(1)), int(m.group(2) or 0))] = True
    if not found:
        raise LayoutError(f"{root}: no mp_rank_XX or mp_rank_XX_YYY directories")
    if len(forms) > 1:
        raise LayoutError(f"{root}: mixes mp_rank_XX and mp_rank_XX_YYY directories")
    tp = max(t for t, _ in found) + 1
    pp = max(p for _, p in found) + 1
    layout = MegatronLegacyLayout(root, tp, pp, with_pp=forms.pop(), layers_per_stage=layers_per_stage)
    layout.check_files()
    return layout


def open_checkpoint(
    path: str | os.PathLike[str],
    layers_per_stage: Sequence[int] | None = None,
    iteration: int | str | None = None,
) -> CheckpointLayout:
    """Opens a sharded checkpoint, recognising its layout.

    Looks, in order, for ``mesh.json`` (own layout); ``mp_rank_XX[_YYY]`` directories; then
    ``latest_checkpointed_iteration.txt`` naming an ``iter_NNNNNNN``/``release`` directory; then the newest
    ``iter_NNNNNNN`` directory (Megatron-LM legacy). Every shard file is checked to exist.

    Args:
        path: the checkpoint directory.
        layers_per_stage: overrides the layer count per PP stage (else from mesh.json or inferred).
        iteration: Megatron only: open this iteration (or ``"release"``) instead of the tracked one.

    Raises:
        FileNotFoundError: the directory or a shard file is missing (path named).
        LayoutError: no known layout (the message says what was looked for) or an inconsistent one.
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
        layout: CheckpointLayout = OwnLayout(root, description)
        layout.check_files()
        return layout
    mroot = _megatron_root(root, iteration)
    if mroot is not None:
        return _open_megatron(mroot, layers_per_stage)
    raise LayoutError(
        f"'{root}' is not a known checkpoint layout: looked for {MESH_FILE} (distribute_utils layout), "
        f"mp_rank_XX/{MEGATRON_FILE} or mp_rank_XX_YYY/{MEGATRON_FILE} directories, {_TRACKER}, and "
        "iter_NNNNNNN directories (Megatron-LM legacy layout)"
    )


# --------------------------------------------------------------------------------------------------------
# Planning from metadata.


@dataclass(frozen=True)
class MergePlanEntry:
    """One output tensor: where its shards are and how to merge them.

    Attributes:
        name: global (renumbered) name in the output.
        pp_rank: the stage holding it.
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
    """Plans a TP x PP consolidation from metadata alone, stage by stage, in file order.

    Checks that every TP rank of a stage holds the same names, that the rule accepts their dtypes and
    shapes, and that no global name comes from two stages (non-layer duplicates such as tied embeddings
    keep the earliest stage, with a warning).

    Args:
        layout: the opened checkpoint.
        rules: merge rules; ``RuleTable.default()`` when ``None``.

    Raises:
        LayoutError: names differ between TP ranks, or a layer name appears on two stages.
        MergeError: a rule rejects the shards' shapes or dtypes.
    """
    table = rules if rules is not None else RuleTable.default()
    plan: list[MergePlanEntry] = []
    seen: dict[str, int] = {}
    ranks_tp = list(range(layout.tp))
    for p in range(layout.pp):
        per_rank = [{s.name: s for s in layout.shard_specs(t, p)} for t in ranks_tp]
        names = list(per_rank[0])
        for t in ranks_tp[1:]:
            if set(per_rank[t]) != set(names):
                missing = sorted(set(names) - set(per_rank[t]))[:5]
                extra = sorted(set(per_rank[t]) - set(names))[:5]
                raise LayoutError(
                    f"stage {p}: TP rank {t} holds different tensors than TP rank 0 "
                    f"(missing {missing}, extra {extra}) in '{layout.file_for(t, p)}'"
                )
        for local in names:
            name = layout.global_name(local, p)
            if name in seen:
                if _local_layer_index(local) is not None:
                    raise LayoutError(
                        f"tensor '{name}' comes from stages {seen[name]} and {p}; check layers_per_stage"
                    )
                logger.warning(
                    "tensor '%s' is on stages %d and %d; keeping stage %d", name, seen[name], p, seen[name]
                )
                continue
            seen[name] = p
            rule = table.rule_for(name)
            spec = rule.merged_spec(name, [per_rank[t][local] for t in ranks_tp], ranks_tp)
            plan.append(MergePlanEntry(name, p, local, rule, spec))
    return plan


# --------------------------------------------------------------------------------------------------------
# Writing layouts (for tests, demos and benchmarks).


def _grid(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]]) -> tuple[int, int]:
    if not shards:
        raise ValueError("no shards given")
    tp = max(t for t, _ in shards) + 1
    pp = max(p for _, p in shards) + 1
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in shards]
    if missing:
        raise ValueError(f"shards must cover a full tp={tp} x pp={pp} grid; missing (tp, pp) {missing}")
    return tp, pp


def _atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


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
        raise ValueError(f"unknown file_format {file_format!r}; valid: {', '.join(_FILE_FORMATS)}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tp, pp = _grid(shards)
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
                raise ValueError(f"safetensors shard names must end in .safetensors, got '{path.name}'")
            with SafetensorsWriter(path, [TensorSpec.of(n, x) for n, x in sd.items()]) as w:
                for n, x in sd.items():
                    w.write(n, x)
        else:
            _atomic_torch_save({n: _standalone(x) for n, x in sd.items()}, path)
    _atomic_write_text(root / MESH_FILE, json.dumps(description, indent=2) + "\n")
    return layout


def _nest(sd: Mapping[str, torch.Tensor], depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in sd.items():
        parts = name.split(".", depth)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _standalone(t)
    return out


def write_megatron_legacy(
    directory: str | os.PathLike[str],
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
    iteration: int | None = None,
    nest_depth: int = 0,
) -> MegatronLegacyLayout:
    """Writes shards as a Megatron-LM legacy checkpoint.

    ``mp_rank_XX/model_optim_rng.pt`` when PP is 1, else ``mp_rank_XX_YYY/...``; each file holds
    ``{"model": state_dict, "checkpoint_version": 3.0, "iteration": N}``. With ``iteration``, the shards go
    under ``iter_NNNNNNN/`` and ``latest_checkpointed_iteration.txt`` is written beside it (last).

    Args:
        directory: output directory (created).
        shards: ``{(tp_rank, pp_rank): {local_name: tensor}}`` covering a full grid.
        iteration: training iteration, or ``None`` for a bare ``mp_rank_*`` directory.
        nest_depth: how many leading name components become nested dicts (legacy Megatron nests
            ``language_model`` -> ``encoder`` -> ``layers.0...``); 0 keeps the names flat (Megatron core).
    """
    base = Path(directory)
    root = base if iteration is None else base / f"iter_{iteration:07d}"
    tp, pp = _grid(shards)
    layout = MegatronLegacyLayout(root, tp, pp, with_pp=pp > 1)
    for (t, p), sd in shards.items():
        obj = {"model": _nest(sd, nest_depth), "checkpoint_version": 3.0, "iteration": iteration or 0}
        _atomic_torch_save(obj, layout.file_for(t, p))
    if iteration is not None:
        _atomic_write_text(base / _TRACKER, f"{iteration}\n")
    return layout
