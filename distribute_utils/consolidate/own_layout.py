"""Internal. The project's own checkpoint layout: a directory with ``mesh.json`` and one file per rank
(:class:`OwnLayout`), and :func:`write_own_layout` to write one."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ArgumentError, LayoutError
from .grid import CheckpointLayout, atomic_torch_save, atomic_write_text, flatten_tensors, grid_of
from .safe_load import safe_torch_load
from .safetensors_read import load_safetensors
from .safetensors_writer import SafetensorsWriter
from .specs import TensorSpec
from .torch_writer import standalone

__all__ = ["MESH_FILE", "OwnLayout", "write_own_layout"]

#: Name of the own layout's description file.
MESH_FILE = "mesh.json"
_FILE_FORMATS = ("safetensors", "torch")
_DEFAULT_FILES = {"safetensors": "rank_{rank:05d}.safetensors", "torch": "rank_{rank:05d}.pt"}


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
