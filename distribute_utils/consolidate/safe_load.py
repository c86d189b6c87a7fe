"""Reading ``torch.save`` files without running any pickled code.

:func:`safe_torch_load` is ``torch.load(weights_only=True)`` with one addition: the objects that Megatron-LM,
NeMo and TransformerEngine write beside the weights (``args`` holding their enums, an ``OptimizerConfig``,
rerun-state enums) are rebuilt as inert :class:`StandIn` records instead of being refused or imported.
A stand-in holds the arguments it was built with and runs nothing; no module is imported. Harmless
standard types (``argparse.Namespace``, ``signal.Signals``, numpy RNG state arrays, ...) are rebuilt as
themselves. Any other global is refused, naming it.

Callers that take tensors from a loaded object must check it holds no stand-in where a tensor is expected
(:func:`find_stand_ins`): a stand-in is never a weight.

A file that cannot be read at all (empty, truncated, text, another format) raises
:class:`~.writers.CheckpointFormatError` naming the file and what is wrong with it
(:func:`~.writers.unreadable_file`).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import signal
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import DistributeError
from .writers import unreadable_file

__all__ = [
    "STAND_IN_MODULES",
    "StandIn",
    "UnsafeCheckpointError",
    "find_stand_ins",
    "safe_torch_load",
]

#: Globals from these packages are rebuilt as inert :class:`StandIn` records.
STAND_IN_MODULES: tuple[str, ...] = ("megatron.", "nemo.", "transformer_engine.", "modelopt.")


class UnsafeCheckpointError(DistributeError, ValueError):
    """A ``torch.save`` file holds objects that cannot be loaded without running pickled code."""


class StandIn:
    """An object of a class that was not imported: its qualified name and what it was built from.

    ``value`` is the first constructor argument (an enum's value), ``state`` what the pickle set on it.
    """

    qualname: str = ""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        return self.args[0] if self.args else None

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state")
        if isinstance(state, dict) and name in state:
            return state[name]
        raise AttributeError(f"{self.qualname} stand-in has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<{self.qualname} {', '.join(map(repr, self.args))}>"


_STAND_INS: dict[str, type[StandIn]] = {}


def _stand_in(qualname: str) -> type[StandIn]:
    if qualname not in _STAND_INS:
        _STAND_INS[qualname] = type(qualname.rsplit(".", 1)[-1], (StandIn,), {"qualname": qualname})
    return _STAND_INS[qualname]


def _real_globals() -> list[Any]:
    """Harmless standard types found in real Megatron checkpoints (``args``, RNG states, paths)."""
    allowed: list[Any] = [
        argparse.Namespace,
        types.SimpleNamespace,
        signal.Signals,
        pathlib.PosixPath,
        io.BytesIO,
    ]
    try:
        import numpy as np

        core = getattr(np, "_core", None) or np.core
        allowed += [core.multiarray._reconstruct, np.ndarray, np.dtype]
        allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.uint8)]
        # numpy 1.x pickles under numpy.core, numpy 2.x under numpy._core: allow both spellings.
        allowed.append((core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"))
        allowed.append((core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"))
    except Exception:  # pragma: no cover - numpy is optional
        pass
    return allowed


_SCANNED: dict[tuple[str, int, int], list[str]] = {}  # (path, size, mtime_ns) -> its stand-in globals


def _globals_for(path: Path) -> list[Any]:
    """The allow-list for one file: the standard types, and a stand-in for each package global it names
    (found by scanning its pickle once; a file re-mapped later is not scanned again)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SCANNED:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # not a zip checkpoint: torch.load will say what is wrong
            names = []
        _SCANNED[key] = [n for n in names if n.startswith(STAND_IN_MODULES)]
    return _real_globals() + [(_stand_in(name), name) for name in _SCANNED[key]]


def safe_torch_load(path: str | os.PathLike[str]) -> Any:
    """``torch.load(weights_only=True, mmap=True, map_location="cpu")`` that also reads Megatron's files.

    Tensors, containers, plain scalars and the standard types above load as themselves; globals of
    :data:`STAND_IN_MODULES` load as :class:`StandIn` records. Files in the pre-1.6 (non-zip) format cannot be
    mapped and are read into memory instead.

    Raises:
        FileNotFoundError: no such file.
        UnsafeCheckpointError: the file holds other objects (named in the message); nothing was run.
        CheckpointFormatError: the file cannot be read (empty, truncated, corrupt, not a ``torch.save`` file);
            the message names it and says which.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint shard '{p}' does not exist")
    try:
        with torch.serialization.safe_globals(_globals_for(p)):
            try:
                return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            unsafe = [
                n
                for n in torch.serialization.get_unsafe_globals_in_checkpoint(p)
                if not n.startswith(STAND_IN_MODULES)
            ]
        except Exception:  # not a readable archive: corrupt, not unsafe
            unsafe = []
        if not unsafe:
            raise unreadable_file(p, exc) from None
        raise UnsafeCheckpointError(
            f"'{p}' holds Python objects that cannot be loaded without running pickled code "
            f"({', '.join(unsafe)}); distribute_utils never unpickles arbitrary objects. Save the model's "
            "tensors alone (a state dict of tensors) where the model is defined, and consolidate that"
        ) from None
    except Exception as exc:  # torch raises anything on a damaged file: EOFError, KeyError, RuntimeError
        raise unreadable_file(p, exc) from None


def find_stand_ins(tree: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every :class:`StandIn` inside nested dicts, lists and tuples."""
    if isinstance(tree, StandIn):
        yield prefix or "<root>"
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from find_stand_ins(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from find_stand_ins(value, f"{prefix}.{i}" if prefix else str(i))
