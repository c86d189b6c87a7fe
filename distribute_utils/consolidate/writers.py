"""Internal. Streaming checkpoint writers, chosen by format name: :func:`open_writer`, and :func:`output_paths` (the
files it would write).

* :class:`~.safetensors_writer.SafetensorsWriter` writes each tensor straight to its offset with
  ``os.pwrite`` and keeps nothing in memory;
* :class:`~.torch_writer.TorchSaveWriter` (``torch.save`` format) has to pickle a file in one go, so it
  keeps the tensors of each *incomplete* output file and flushes a file as soon as its last tensor arrives.

Both share :class:`~.writer_base.CheckpointWriter` (specs, split, temporaries, close/abort). Also kept here
for the names imported from this module: byte sizes and dtype names (:mod:`.specs`), reading safetensors
(:mod:`.safetensors_read`) and unreadable files (:mod:`.unreadable`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import ArgumentError, CheckpointFormatError, OutputError
from .safetensors_read import read_safetensors_metadata, read_safetensors_specs
from .safetensors_writer import SafetensorsWriter
from .specs import DTYPE_TO_SAFETENSORS, TensorSpec, parse_size
from .torch_writer import TorchSaveWriter
from .writer_base import CheckpointWriter, plan_shards, split_target

__all__ = [
    "DTYPE_TO_SAFETENSORS",
    "CheckpointFormatError",
    "open_writer",
    "output_paths",
    "parse_size",
    "read_safetensors_metadata",
    "read_safetensors_specs",
]


def open_writer(
    format: str,
    out: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    side_files: Mapping[str, bytes] | None = None,
) -> CheckpointWriter:
    """Creates a writer by format name.

    Args:
        format: ``"safetensors"`` or ``"torch"``.
        out: output directory (or file path, see the writer classes).
        specs: every tensor, in output order.
        max_shard_size: bytes per shard (int or ``"5GB"``), or ``None`` for one file.
        metadata: safetensors ``__metadata__`` (ignored by the torch writer).
        side_files: small files written beside the tensors' (name -> bytes: a ``config.json``),
            published with them.

    Raises:
        ValueError: unknown format (valid ones listed).
    """
    if format == "safetensors":
        return SafetensorsWriter(out, specs, max_shard_size, metadata=metadata, side_files=side_files)
    cls = _writer_class(format)
    if side_files:
        raise ArgumentError(f"side files are written by the safetensors writer only, not {cls.__name__}")
    return cls(out, specs, max_shard_size)


def _writer_class(format: str) -> type[CheckpointWriter]:
    writers: dict[str, type[CheckpointWriter]] = {"safetensors": SafetensorsWriter, "torch": TorchSaveWriter}
    if format not in writers:
        raise ArgumentError(f"unknown checkpoint format {format!r}; valid: {', '.join(writers)}")
    return writers[format]


def output_paths(
    format: str,
    out: str | os.PathLike[str],
    specs: Sequence[TensorSpec] | None = None,
    max_shard_size: int | str | None = None,
    side_files: Sequence[str] = (),
) -> tuple[list[Path], str]:
    """The files :func:`open_writer` would write for these arguments, without creating anything, and a
    regular expression matching the names of that naming scheme under any split (what loaders would mix
    with them: for a directory written in torch format also ``model*.safetensors``, which Hugging Face
    loaders prefer).

    ``specs`` are needed only with ``max_shard_size`` (they decide the split); ``side_files``: the names
    of the small files written beside them (:func:`open_writer`'s).

    Raises:
        ValueError: unknown format; ``out`` ends in the other format's extension; ``max_shard_size``
            without ``specs``.
    """
    cls = _writer_class(format)
    suffix = Path(out).suffix
    if suffix in (".safetensors", ".bin") and suffix != cls.suffix and not Path(out).is_dir():
        raise OutputError(
            f"output '{out}' ends in {suffix}, but the {format} format writes {cls.suffix} files; give a "
            f"file name ending in {cls.suffix}, or a directory"
        )
    directory, stem = split_target(out, cls.suffix, cls.default_stem)
    if max_shard_size is None:
        n = 1
    elif specs is None:
        raise ArgumentError(
            "output_paths: max_shard_size needs the specs (they decide the split); pass specs too"
        )
    else:
        n = len(plan_shards(specs, parse_size(max_shard_size)))
    files, index = cls.names(stem, n)
    scheme = cls.scheme(stem)
    if cls is not SafetensorsWriter and stem == cls.default_stem:
        scheme += "|" + SafetensorsWriter.scheme(SafetensorsWriter.default_stem)
    names = [*files, *side_files, *([index] if index else [])]
    return [directory / f for f in names], scheme
