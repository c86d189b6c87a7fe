"""Internal. The wire format itself: the prefix and its fields, the header's constants and ext codes, the dtype
table, and the small helpers that :mod:`.payload`, :mod:`.encoding`, :mod:`.header`, :mod:`.tree` and
:mod:`.decoding` share (all of them import this module; it imports none of them).

The specification is ``docs/wire-format.md``; :mod:`distribute_utils.wire` re-exports the public names.
"""

from __future__ import annotations

import reprlib
import struct
import types
from collections.abc import Mapping
from typing import Any

import msgpack
import torch

from ..errors import PayloadError, UnsupportedTypeError

__all__ = [
    "ALIGN",
    "CARRIERS",
    "DEFAULT_MAX_HEADER_BYTES",
    "DTYPE_BY_NAME",
    "EXT_BIGINT",
    "EXT_DATACLASS",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "EXT_TYPED",
    "FLAG_CHECKSUM",
    "HEADER_LEN_AT",
    "LENGTH_FIELD",
    "LONE_TREE",
    "MAGIC",
    "MAX_DEPTH",
    "PREFIX_SIZE",
    "PREFIX_STRUCT",
    "READABLE_VERSIONS",
    "RECENT_BYTES_MAX",
    "RECENT_MAX",
    "SOURCE_DEVICE",
    "SUPPORTED_DTYPES",
    "TOTAL_LEN_AT",
    "VERSION",
    "VERSION_FIELD",
    "align",
    "bytes_view",
    "malformed",
    "pack",
    "short_repr",
    "type_name",
]

MAGIC: bytes = b"DUW1"
"""First four bytes of every payload."""
VERSION: int = 2
"""Format version written by :func:`encode` (2: each tensor entry names its sender's device)."""
READABLE_VERSIONS: tuple[int, ...] = (1, 2)
"""Versions :func:`decode` reads (a version 1 entry has no device: its tensor was on the CPU)."""
SOURCE_DEVICE: str = "source"
"""``decode(buf, device=SOURCE_DEVICE)``: each tensor on the device its sender had it on (as
``torch.load`` restores it)."""
ALIGN: int = 64
"""Every tensor's offset is a multiple of this many bytes."""
PREFIX_SIZE: int = 32
"""Size of the fixed prefix in front of the msgpack header."""
DEFAULT_MAX_HEADER_BYTES: int = 64 * 2**20
"""Largest msgpack header :func:`decode` accepts unless told otherwise."""
FLAG_CHECKSUM: int = 1
"""Flags bit 0: the checksum field holds the CRC-32 of every byte after the prefix."""
MAX_DEPTH: int = 200
"""Deepest nesting of containers (list, tuple, dict, dataclass) in a config tree."""

EXT_TENSOR: int = 1
"""msgpack ext code: reference to a tensor; data = msgpack uint index into ``"t"``."""
EXT_TUPLE: int = 2
"""msgpack ext code with empty data: marks an array ``[ext2, item0, item1, ...]`` as a tuple."""
EXT_BIGINT: int = 3
"""msgpack ext code: int outside [-2**63, 2**64); data = two's-complement little-endian bytes."""
EXT_DATACLASS: int = 4
"""msgpack ext code with empty data: marks an array ``[ext4, module, qualname, {field: value}]``."""
EXT_TYPED: int = 5
"""msgpack ext code with empty data: marks an array ``[ext5, kind, ...]``: ``"enum"``, module,
qualname, value; ``"odict"``, {key: value}; ``"np"``, dtype string, raw bytes (a numpy
scalar); ``"ndarray"``, tensor reference (a numpy array, its bytes travel as a tensor)."""

PREFIX_STRUCT = struct.Struct("<4sHHQQQ")
"""The prefix: magic, version, flags, header length, total length, checksum (little-endian)."""
VERSION_FIELD = struct.Struct("<H")  # the prefix's version field, at byte 4
LENGTH_FIELD = struct.Struct("<Q")  # the prefix's header length and total length fields (at these offsets)
HEADER_LEN_AT, TOTAL_LEN_AT = 8, 16
assert PREFIX_STRUCT.size == PREFIX_SIZE

_QUANTIZED_NAMES = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
_QUANTIZED = frozenset(getattr(torch, n) for n in _QUANTIZED_NAMES if hasattr(torch, n))


def _dtype_table() -> dict[str, torch.dtype]:
    """Every real ``torch.dtype`` of this torch build except quantized ones, by canonical name."""
    table: dict[str, torch.dtype] = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and value not in _QUANTIZED:
            table[str(value).removeprefix("torch.")] = value
    return dict(sorted(table.items()))


DTYPE_BY_NAME: Mapping[str, torch.dtype] = types.MappingProxyType(_dtype_table())
"""The dtype each name of :data:`SUPPORTED_DTYPES` stands for (what :func:`decode` reads a tensor entry's
dtype name as; tests check it against torch's)."""
SUPPORTED_DTYPES: tuple[str, ...] = tuple(DTYPE_BY_NAME)
"""Names of the dtypes a payload may carry (``str(dtype)`` without the ``torch.`` prefix)."""

# Same-itemsize dtypes with copy kernels everywhere: sub-byte shells (int4, uint3, ...) and
# float8 kinds lack some kernels, so strided copies go through a bit-identical view.
CARRIERS: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
    16: torch.complex128,
}


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN` (where the next tensor may start)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def type_name(tp: type) -> str:
    """``tp``'s name as error messages show it: qualified by its module unless it is a builtin."""
    module = getattr(tp, "__module__", None)
    name = getattr(tp, "__qualname__", repr(tp))
    return name if module in (None, "builtins") else f"{module}.{name}"


def bytes_view(buf: Any) -> memoryview:
    """A flat, byte-format memoryview of ``buf`` (bytes, bytearray, mmap, memoryview, ndarray...)."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise UnsupportedTypeError(
            f"expected a bytes-like object (bytes, bytearray, memoryview, mmap), got {type_name(type(buf))}"
        ) from None
    if mv.ndim != 1 or mv.format != "B":
        if not mv.c_contiguous:
            raise UnsupportedTypeError("the payload buffer must be C-contiguous")
        mv = mv.cast("B")
    return mv


RECENT_MAX = 256  # layouts and headers kept
RECENT_BYTES_MAX = 1 << 16  # larger keys are worked out every time rather than kept


def pack(obj: Any) -> bytes:
    """``obj`` as msgpack bytes, as the format writes them (``bytes`` as msgpack bin)."""
    return msgpack.packb(obj, use_bin_type=True)


LONE_TREE = pack(msgpack.ExtType(EXT_TENSOR, pack(0)))
"""The tree of a payload that is one tensor (``get_tensors_parallel``): a reference to tensor 0."""

_MSGPACK_DEPTH = 1024  # msgpack's unpacker nests at most this many containers


def malformed(e: Exception, what: str = "malformed header") -> PayloadError:
    """The error for a header msgpack could not unpack (``e``), prefixed with ``what``."""
    if isinstance(e, msgpack.StackError):
        return PayloadError(
            f"{what}: containers nested deeper than msgpack's limit of {_MSGPACK_DEPTH} levels (encode "
            f"writes at most {MAX_DEPTH} nested containers); a corrupt or crafted header"
        )
    return PayloadError(f"{what}: {type(e).__name__}: {e}")


_REPR = reprlib.Repr()  # error messages show what a crafted header holds: a few levels, a few items
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 8
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 100


def short_repr(value: Any, limit: int) -> str:
    """``repr(value)`` cut to ``limit`` characters, built without recursing deeper than a few levels or
    reading more than a few items (a crafted header nests arrays up to msgpack's limit of 1024)."""
    return _REPR.repr(value)[:limit]
