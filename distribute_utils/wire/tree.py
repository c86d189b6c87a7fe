"""Internal. Decoding a payload's config tree: the ``"v"`` span of its header in one msgpack pass
(:func:`decode_tree`), with tensor references resolved, tuples, big ints, dataclasses, enums,
``OrderedDict`` and numpy values rebuilt, and classes looked up only in modules already imported
(nothing is unpickled, nothing imported).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import sys
from typing import Any

import msgpack
import torch

from ..errors import PayloadError
from .format import (
    EXT_BIGINT,
    EXT_DATACLASS,
    EXT_TENSOR,
    EXT_TUPLE,
    EXT_TYPED,
    malformed,
    short_repr,
    type_name,
)

__all__ = ["decode_tree"]


class _Marker:
    """What the decoder's ext hook returns for the tuple/dataclass markers (never escapes)."""

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind


_TUPLE_MARK = _Marker("tuple")
_DATACLASS_MARK = _Marker("dataclass")
_TYPED_MARK = _Marker("typed")
# Types that must not survive into a decoded tree: stray markers, and msgpack's built-in
# timestamp (ext -1), which msgpack decodes itself without asking the ext hook.
_FORBIDDEN = frozenset({_Marker, msgpack.Timestamp})


def _forbidden(value: Any) -> PayloadError:
    if type(value) is _Marker:
        return PayloadError(f"misplaced {value.kind} marker: expected it only as the first item of an array")
    return PayloadError("unknown ext type -1 (msgpack timestamp): expected codes 1-4")


def _check_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    for key, value in pairs:
        tk = type(key)
        if tk is not str and tk is not int:
            raise PayloadError(
                f"dict key {short_repr(key, 60)} of type {type_name(tk)}: expected str or int keys"
            )
        if type(value) in _FORBIDDEN:
            raise _forbidden(value)
    return dict(pairs)


def _check_list(items: list[Any]) -> Any:
    """Turn marked arrays into tuples / dataclasses; reject stray markers (runs bottom-up, in C order)."""
    kind = items[0] if items else None
    if kind is _TUPLE_MARK or kind is _DATACLASS_MARK or kind is _TYPED_MARK:
        rest = items[1:]
        bad = _FORBIDDEN.intersection(map(type, rest))
        if bad:
            raise _forbidden(next(x for x in rest if type(x) in _FORBIDDEN))
        if kind is _TUPLE_MARK:
            return tuple(rest)
        return _rebuild_dataclass(rest) if kind is _DATACLASS_MARK else _rebuild_typed(rest)
    if _FORBIDDEN.intersection(map(type, items)):
        raise _forbidden(next(x for x in items if type(x) in _FORBIDDEN))
    return items


def decode_tree(v_bytes: memoryview, tensors: list[torch.Tensor]) -> object:
    """Decode the ``"v"`` span in one msgpack pass (no nested unpacking, so no deep C recursion)."""
    n_tensors = len(tensors)

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            index = msgpack.unpackb(data) if data else None
            if type(index) is not int or not 0 <= index < n_tensors:
                raise PayloadError(
                    f"tensor reference {short_repr(index, 40)} out of range: the payload has {n_tensors} tensors"
                )
            return tensors[index]
        if code == EXT_BIGINT:
            if not data:
                raise PayloadError("empty big-int ext data: expected two's-complement bytes")
            return int.from_bytes(data, "little", signed=True)
        if code in (EXT_TUPLE, EXT_DATACLASS, EXT_TYPED):
            if data:
                raise PayloadError(f"ext type {code} marker carries {len(data)} data bytes, expected none")
            return {EXT_TUPLE: _TUPLE_MARK, EXT_DATACLASS: _DATACLASS_MARK, EXT_TYPED: _TYPED_MARK}[code]
        raise PayloadError(
            f"unknown ext type {code}: expected 1 (tensor), 2 (tuple), 3 (big int), 4 (dataclass) or 5 "
            "(enum, OrderedDict, numpy); "
            "was the payload written by a newer version?"
        )

    try:
        tree = msgpack.unpackb(
            v_bytes,
            raw=False,
            strict_map_key=False,
            ext_hook=ext_hook,
            object_pairs_hook=_check_pairs,
            list_hook=_check_list,
        )
    except PayloadError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as e:
        raise malformed(e) from None
    if type(tree) in _FORBIDDEN:
        raise _forbidden(tree)
    return tree


def _rebuild_typed(value: list[Any]) -> object:
    kind = value[0] if value else None
    try:
        if kind == "enum" and len(value) == 4 and type(value[1]) is str and type(value[2]) is str:
            cls = _find_class(value[1], value[2], "enum")
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
                raise PayloadError(f"{value[1]}.{value[2]} is not an enum; refusing to build it")
            return cls(value[3])
        if kind == "odict" and len(value) == 2 and type(value[1]) is dict:
            return collections.OrderedDict(value[1])
        if kind == "np" and len(value) == 3 and type(value[1]) is str and type(value[2]) is bytes:
            np = _numpy()
            dtype = np.dtype(value[1])
            if dtype.kind not in "biufc" or dtype.itemsize != len(value[2]):
                raise PayloadError(
                    f"numpy scalar of dtype {short_repr(value[1], 20)} with {len(value[2])} bytes"
                )
            return np.frombuffer(value[2], dtype=dtype)[0]
        if kind == "ndarray" and len(value) == 2 and isinstance(value[1], torch.Tensor):
            _numpy()
            return value[1].numpy()
    except PayloadError:
        raise
    except (ValueError, TypeError) as e:
        raise PayloadError(f"typed value {short_repr(kind, 20)} cannot be rebuilt: {e}") from None
    raise PayloadError(f"typed-value marker followed by {short_repr(value, 100)}: unknown kind or layout")


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise PayloadError("the payload holds numpy values: install numpy on the reading rank") from None
    return numpy


def _rebuild_dataclass(value: list[Any]) -> object:
    if (
        len(value) != 3
        or type(value[0]) is not str
        or type(value[1]) is not str
        or type(value[2]) is not dict
    ):
        raise PayloadError(
            f"dataclass marker followed by {short_repr(value, 100)}, expected module, qualname, {{field: value}}"
        )
    module, qualname, stored = value
    cls = _find_class(module, qualname, "dataclass")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise PayloadError(
            f"{module}.{qualname} is a {type_name(type(cls))}, expected a dataclass type; refusing to build it"
        )
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    if set(names) != set(stored) or len(names) != len(stored):
        raise PayloadError(
            f"dataclass {module}.{qualname}: the payload has fields {sorted(map(str, stored))} but the class "
            f"has {sorted(names)}; use the same class definition on every rank"
        )
    try:
        obj = object.__new__(cls)
        for name in names:
            object.__setattr__(obj, name, stored[name])
    except (TypeError, AttributeError) as e:
        raise PayloadError(f"dataclass {module}.{qualname} cannot be rebuilt without __init__: {e}") from None
    return obj


def _find_class(module: str, qualname: str, what: str) -> Any:
    """The class ``module.qualname``, from a module the reader has imported already.

    Nothing is imported: a payload naming a module must never run that module's code (as
    ``torch.load(weights_only=True)`` allows only known globals). Import the module on the
    reading rank before the gather (the config's own package usually is).
    """
    full = f"{module}.{qualname}"
    parts = qualname.split(".")
    if not all(p.isidentifier() for p in module.split(".")) or not all(p.isidentifier() for p in parts):
        raise PayloadError(f"{what} {full!r:.200} not found: not a valid module path and qualified name")
    mod = sys.modules.get(module)
    if mod is None:
        raise PayloadError(
            f"{what} {full} not found: module {module!r} is not imported on the reading rank, and payloads "
            f"never import modules; import {module} there before the gather"
        )
    obj: Any = mod
    for part in parts:
        try:
            obj = getattr(obj, part)
        except Exception:
            raise PayloadError(f"{what} {full} not found: module {module!r} has no {qualname!r}") from None
    return obj
