"""Internal. Reading safetensors files through ``safetensors.safe_open``: metadata, tensor specs (header only),
tensors (memory-mapped)."""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

from ..errors import CheckpointFormatError
from .specs import SAFETENSORS_TO_DTYPE, TensorSpec
from .unreadable import unreadable_file

__all__ = ["load_safetensors", "read_safetensors_metadata", "read_safetensors_specs"]


def _open_safetensors(path: str | os.PathLike[str]) -> Any:
    """``safetensors.safe_open`` (torch framework), its errors as :class:`CheckpointFormatError` naming the file."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "no such safetensors file", os.fspath(path))
    try:
        return safe_open(os.fspath(path), framework="pt")
    except SafetensorError as exc:
        raise unreadable_file(path, exc, "safetensors file") from None


def read_safetensors_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """Returns the ``__metadata__`` map of a safetensors file (empty when absent)."""
    with _open_safetensors(path) as f:
        return dict(f.metadata() or {})


def _specs_of(path: str | os.PathLike[str], f: Any) -> list[TensorSpec]:
    """The specs of an open safetensors file in file (offset) order; a dtype torch lacks is an error."""
    specs = []
    for name in f.offset_keys():
        piece = f.get_slice(name)
        dtype = SAFETENSORS_TO_DTYPE.get(piece.get_dtype())
        if dtype is None:
            raise CheckpointFormatError(
                f"'{path}': tensor '{name}' has unsupported dtype {piece.get_dtype()!r}; "
                f"supported: {', '.join(SAFETENSORS_TO_DTYPE)}"
            )
        specs.append(TensorSpec(name, dtype, tuple(piece.get_shape())))
    return specs


def read_safetensors_specs(path: str | os.PathLike[str]) -> list[TensorSpec]:
    """Reads only the header of a safetensors file and returns its tensor specs, in file (offset) order.

    Raises:
        CheckpointFormatError: malformed header, or a dtype torch has no type for (the message says which).
    """
    with _open_safetensors(path) as f:
        return _specs_of(path, f)


def load_safetensors(path: str | os.PathLike[str], mmap: bool = True) -> dict[str, torch.Tensor]:
    """Loads a safetensors file as ``{name: tensor}`` in file order, with ``safetensors.safe_open``.

    With ``mmap=True`` (default) the tensors are backed by a private (copy-on-write) mapping of the file:
    nothing is read until touched, and writing to a tensor never changes the file. With ``mmap=False``
    the file is read into memory once.

    Raises:
        CheckpointFormatError: not a valid safetensors file, or a dtype torch has no type for.
    """
    with _open_safetensors(path) as f:
        names = [s.name for s in _specs_of(path, f)]
        if mmap:
            return {name: f.get_tensor(name) for name in names}
    from safetensors.torch import load

    with open(path, "rb") as raw:
        tensors = load(raw.read())
    return {name: tensors[name] for name in names}
