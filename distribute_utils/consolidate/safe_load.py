"""Internal. Reading ``torch.save`` files without running any pickled code.

:func:`safe_torch_load` is ``torch.load(weights_only=True)`` with one addition: the objects that Megatron-LM,
NeMo and TransformerEngine write beside the weights (``args`` holding their enums, an ``OptimizerConfig``,
rerun-state enums) are rebuilt as inert :class:`StandIn` records instead of being refused or imported.
A stand-in holds the arguments it was built with and runs nothing; no module is imported. Harmless
standard types (``argparse.Namespace``, ``signal.Signals``, numpy RNG state arrays, ...) are rebuilt as
themselves. Any other global is refused, naming it.

Callers that take tensors from a loaded object must check it holds no stand-in where a tensor is expected
(:func:`find_stand_ins`): a stand-in is never a weight.

A file that cannot be read at all (empty, truncated, text, another format) raises
:class:`~distribute_utils.errors.CheckpointFormatError` naming the file and what is wrong with it
(:func:`~.unreadable.unreadable_file`).

:func:`safe_pickle_load` reads a plain pickle (not a ``torch.save`` archive, e.g. a DCP ``.metadata`` file,
which torch's weights-only reader cannot parse) with the same promise: only the globals of an allow-list the
caller gives are looked up, anything else is refused by name before it is built, and no pickled code runs.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import signal
import types
from collections.abc import Iterator, Mapping
from enum import EnumMeta
from pathlib import Path
from typing import Any

import torch

from ..caches import Recent
from ..errors import UnsafeCheckpointError
from .unreadable import unreadable_file

__all__ = [
    "STAND_IN_MODULES",
    "StandIn",
    "UnsafeCheckpointError",
    "find_stand_ins",
    "safe_pickle_load",
    "safe_torch_load",
]

#: Globals from these packages are rebuilt as inert :class:`StandIn` records.
STAND_IN_MODULES: tuple[str, ...] = ("megatron.", "nemo.", "transformer_engine.", "modelopt.")


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


# A memo: (path, size, mtime_ns) -> the stand-in globals the file names.
_SCANNED: Recent[tuple[str, int, int], list[str]] = Recent(256)


def _globals_for(path: Path) -> list[Any]:
    """The allow-list for one file: the standard types, and a stand-in for each package global it names
    (found by scanning its pickle once; a file re-mapped later is not scanned again)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    scanned = _SCANNED.get(key)
    if scanned is None:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # not a zip checkpoint: torch.load will say what is wrong
            names = []
        scanned = _SCANNED.put(key, [n for n in names if n.startswith(STAND_IN_MODULES)])
    return _real_globals() + [(_stand_in(name), name) for name in scanned]


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
        raise _unsafe(
            p,
            unsafe,
            "Save the model's tensors alone (a state dict of tensors) where the model is defined, and "
            "consolidate that",
        ) from None
    except Exception as exc:  # torch raises anything on a damaged file: EOFError, KeyError, RuntimeError
        raise unreadable_file(p, exc) from None


def _unsafe(path: Path, names: list[str], advice: str) -> UnsafeCheckpointError:
    """The refusal of a file that names globals outside the allow-list (one line)."""
    return UnsafeCheckpointError(
        f"'{path}' holds Python objects that cannot be loaded without running pickled code "
        f"({', '.join(names)}); distribute_utils never unpickles arbitrary objects. {advice}"
    )


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (raised by the unpickler before the global is looked up)."""


class _AllowListUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that looks globals up in a fixed map instead of importing them.

    Every class, function or constant a pickle names (``GLOBAL``, ``STACK_GLOBAL``, copyreg extensions) goes
    through ``find_class``: one outside ``allowed`` stops the load at once, so a ``__reduce__`` to
    ``os.system`` or ``builtins.exec`` is never reached, let alone called. Persistent ids are refused by
    ``pickle.Unpickler`` itself.
    """

    def __init__(self, file: Any, allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"{module}.{name}") from None


def _shared_state(allowed: Mapping[tuple[str, str], Any]) -> list[tuple[Any, dict[str, Any]]]:
    """The attributes of every allow-listed object a pickle could reach and change for the whole process (a
    ``BUILD`` on a class, or on an enum member a class call returns), copied before a load."""
    objects: list[Any] = []
    for obj in allowed.values():
        objects.append(obj)
        if isinstance(obj, EnumMeta):
            objects += list(obj)
    seen: set[int] = set()
    shared = []
    for obj in objects:
        if id(obj) not in seen and hasattr(obj, "__dict__"):
            seen.add(id(obj))
            shared.append((obj, dict(vars(obj))))
    return shared


def _restore(shared: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """Puts back what a load changed on the objects of :func:`_shared_state`; returns their names."""
    changed = []
    for obj, before in shared:
        now = vars(obj)
        if now.keys() == before.keys() and all(now[k] is v for k, v in before.items()):
            continue
        for key in [k for k in now if k not in before]:
            delattr(obj, key)
        for key, value in before.items():
            if key not in now or now[key] is not value:
                setattr(obj, key, value)
        changed.append(getattr(obj, "__qualname__", None) or str(obj))  # a class, or an enum member
    return changed


def safe_pickle_load(
    path: str | os.PathLike[str], allowed: Mapping[tuple[str, str], Any], advice: str
) -> Any:
    """Unpickles a plain pickle file whose globals must all be in ``allowed``; runs no pickled code.

    ``allowed`` maps ``(module, name)`` as the pickle spells it to the object to use; nothing is imported.
    Only those objects are ever called (a class to build an instance, a function with the pickle's
    arguments): the caller must list only constructors that run no code of the file's choosing (dataclasses,
    enums, ``torch.Size``, ...). A pickle that changes an allow-listed class or enum member (a ``BUILD`` on
    it) is put back and refused. ``advice`` ends the refusal (what the user should do).

    Raises:
        FileNotFoundError: no such file.
        UnsafeCheckpointError: the file names a global outside ``allowed`` (named in the one-line message;
            it was not looked up, nothing was called) or changes an allow-listed object.
        Exception: whatever ``pickle`` raises on a damaged file (``UnpicklingError``, ``EOFError``, ...);
            the caller says what is wrong (:func:`~.unreadable.describe_unreadable`).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file '{p}' does not exist")
    shared = _shared_state(allowed)
    try:
        with open(p, "rb") as f:
            obj = _AllowListUnpickler(f, allowed).load()
    except _Refused as exc:
        raise _unsafe(p, [str(exc)], advice) from None
    finally:
        changed = _restore(shared)
    if changed:
        raise _unsafe(p, [f"a change to {name}" for name in changed], advice)
    return obj


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
