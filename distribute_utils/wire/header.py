"""Internal. Reading a payload's head: the 32-byte prefix (:func:`read_prefix`, :func:`stated_length`), the
header map (:func:`parse_header`: where the tree and the tensor table are) and the tensor table
(:func:`tensor_table`: every entry checked against the payload's bounds, at a memory cost bounded per
payload byte, recent tables kept). Everything here trusts no byte; :mod:`.decoding` builds tensors
from the :class:`Slot` entries it returns.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import msgpack
import torch

from ..caches import Recent
from ..errors import PayloadError
from .format import (
    ALIGN,
    DEFAULT_MAX_HEADER_BYTES,
    DTYPE_BY_NAME,
    FLAG_CHECKSUM,
    LENGTH_FIELD,
    MAGIC,
    PREFIX_SIZE,
    PREFIX_STRUCT,
    READABLE_VERSIONS,
    RECENT_BYTES_MAX,
    RECENT_MAX,
    TOTAL_LEN_AT,
    align,
    bytes_view,
    malformed,
    short_repr,
)

__all__ = [
    "TABLE_BYTES_CONSTANT",
    "TABLE_BYTES_PER_BYTE",
    "PayloadPrefix",
    "Slot",
    "parse_header",
    "read_prefix",
    "stated_length",
    "tensor_table",
]

_KNOWN_FLAGS = FLAG_CHECKSUM
_MIN_HEADER = 7  # b"\x82\xa1v\xc0\xa1t\x90" == {"v": None, "t": []}

_MAX_NDIM = 64
_MAX_EMPTY_TENSORS = 4096  # plus one per 64 payload bytes (see _build_tensors)
_MAX_DIM = 2**63 - 1


class PayloadPrefix(NamedTuple):
    """The fixed prefix's fields, as :func:`read_prefix` returns them."""

    flags: int
    header_len: int
    total_len: int
    checksum: int


def read_prefix(buf: Any, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> PayloadPrefix:
    """Read and validate the 32-byte prefix.

    Needs only the first :data:`PREFIX_SIZE` bytes, so a reader can learn the total length
    before mapping or reading the rest; it does not check that ``buf`` holds all of it.

    Args:
        buf: a bytes-like object starting with the payload.
        max_header_bytes: the largest header length accepted.

    Returns:
        ``(flags, header_len, total_len, checksum)`` as a :class:`PayloadPrefix`.

    Raises:
        PayloadError: fewer than 32 bytes, bad magic, unsupported version, unknown flags, a
            checksum field without its flag, or inconsistent lengths.
    """
    with bytes_view(buf) as mv:  # released before any error, so an mmap can be closed after one
        nbytes = mv.nbytes
        fields = PREFIX_STRUCT.unpack_from(mv) if nbytes >= PREFIX_SIZE else None
    if fields is None:
        raise PayloadError(f"truncated: payload prefix needs {PREFIX_SIZE} bytes, got {nbytes}")
    magic, version, flags, header_len, total_len, checksum = fields
    if magic != MAGIC:
        raise PayloadError(
            f"bad magic {magic!r}: expected {MAGIC!r}; this is not a distribute_utils payload "
            "(or its writer had not finished)"
        )
    if version not in READABLE_VERSIONS:
        raise PayloadError(
            f"unsupported wire format version {version}: this reader supports versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; use the same distribute_utils version on every rank"
        )
    if flags & ~_KNOWN_FLAGS:
        raise PayloadError(f"unknown flags 0x{flags:04x}: expected only bit 0 (checksum) to be set")
    if flags & FLAG_CHECKSUM:
        if checksum > 0xFFFFFFFF:
            raise PayloadError(f"checksum field 0x{checksum:x} is not a CRC-32 value (expected < 2**32)")
    elif checksum:
        raise PayloadError(
            f"checksum field is 0x{checksum:x} but the checksum flag is not set: expected 0 (corrupt prefix)"
        )
    if header_len < _MIN_HEADER:
        raise PayloadError(f"header length {header_len} is too small: expected at least {_MIN_HEADER} bytes")
    if header_len > max_header_bytes:
        raise PayloadError(
            f"header length {header_len} exceeds the limit of {max_header_bytes} bytes; a payload "
            "whose config (strings, bytes, structure) is that large was not written by encode()"
        )
    if total_len < PREFIX_SIZE + header_len:
        raise PayloadError(
            f"total length {total_len} is smaller than prefix + header ({PREFIX_SIZE} + {header_len} bytes)"
        )
    return PayloadPrefix(flags, header_len, total_len, checksum)


def stated_length(buf: Any) -> int:
    """The total length a payload's prefix states, read as it is: :func:`decode` checks the prefix (a
    transport compares it with what the sender said it wrote before handing the bytes on).

    Raises:
        PayloadError: fewer bytes than a prefix.
    """
    if len(buf) < PREFIX_SIZE:
        raise PayloadError(f"truncated: payload prefix needs {PREFIX_SIZE} bytes, got {len(buf)}")
    return int(LENGTH_FIELD.unpack_from(buf, TOTAL_LEN_AT)[0])


def _no_ext(code: int, data: bytes) -> Any:
    raise PayloadError(f"unexpected ext type {code} in the tensor table")


def parse_header(header: memoryview, header_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The byte spans of the header map's ``"v"`` (the tree) and ``"t"`` (the tensor table)."""
    up = msgpack.Unpacker(
        None,
        max_buffer_size=header_len,
        raw=False,
        strict_map_key=False,
        ext_hook=_no_ext,
        max_str_len=header_len,
        max_bin_len=header_len,
        max_array_len=header_len,
        max_map_len=header_len // 2,
        max_ext_len=header_len,
    )
    spans: dict[str, tuple[int, int]] = {}
    try:
        up.feed(header)
        n = up.read_map_header()
        if n != 2:
            raise PayloadError(f'malformed header: a map with {n} entries, expected 2 ("v" and "t")')
        for _ in range(2):
            at = up.tell()
            # The keys are the short strs "v" and "t": anything else is refused before it is unpacked.
            key = up.unpack() if at >= header_len or 0xA0 <= header[at] <= 0xBF else None
            if type(key) is not str or key not in ("v", "t") or key in spans:
                shown = short_repr(key, 60) if key is not None else f"(a msgpack {_msgpack_kind(header[at])})"
                raise PayloadError(
                    f'malformed header: unexpected or repeated key {shown}; expected "v" and "t"'
                )
            start = up.tell()
            up.skip()
            spans[key] = (start, up.tell())
        used = up.tell()
    except PayloadError:
        raise
    except msgpack.OutOfData:
        raise PayloadError(
            f"malformed header: msgpack data ends before the {header_len}-byte header does"
        ) from None
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as e:
        raise malformed(e) from None
    if used != header_len:
        raise PayloadError(
            f"malformed header: msgpack map ends at byte {used} of a {header_len}-byte header; "
            "expected no trailing bytes"
        )
    return spans["v"], spans["t"]


class Slot(NamedTuple):
    """One checked tensor entry, ready to build: where its bytes are and what they are."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: list[int]
    strides: list[int]
    device: str  # where its sender had it ("cpu" for a version 1 payload)


# Checked tensor tables: configs differ in values more often than in shapes.
_TABLES: Recent[Any, Any] = Recent(RECENT_MAX)


def tensor_table(raw: memoryview, header_end: int, total_len: int, version: int) -> tuple[Slot, ...]:
    """The checked tensor table of a payload (``raw``: the msgpack bytes of ``"t"``).

    A table is a pure function of its bytes, where the header ends and the payload's length, so
    a table already checked under the same three is reused (the same shapes come back round
    after round): checking costs several microseconds per tensor, a lookup one per payload.
    """
    key = (raw.tobytes(), header_end, total_len, version) if len(raw) <= RECENT_BYTES_MAX else None
    table = _TABLES.get(key) if key is not None else None
    if table is None:
        table = _read_table(raw, header_end, total_len, version)
        if key is not None:
            _TABLES.put(key, table)
    return table


# Reading a table holds at most TABLE_BYTES_PER_BYTE bytes of Python objects per payload byte, plus
# TABLE_BYTES_CONSTANT, before it is refused or accepted (docs/wire-format.md, section 5). What is kept
# per entry (a Slot: about 200 bytes for an empty tensor, 270 for another) is bounded by the payload's
# size: at most 4096 + one empty tensor per 64 payload bytes, and one non-empty tensor per 64 bytes after
# the header (their offsets are distinct multiples of 64; more and two of them overlap). A long table is
# read entry by entry, each checked as it comes, so that a crafted one is refused before it costs more,
# and no entry of it may be longer than _MAX_ENTRY_BYTES (checked before any is unpacked): what one entry
# unpacks into is small too. A short one is unpacked in one call (the same checks; faster for the
# tables of real payloads), which costs at most ~64 bytes per byte of it (a msgpack byte can be an
# empty list): part of the constant.
TABLE_BYTES_PER_BYTE: int = 8
"""Reading and checking a payload's header holds at most this many bytes of Python objects per payload
byte (plus :data:`TABLE_BYTES_CONSTANT`) until it is refused or its tensors are built."""
TABLE_BYTES_CONSTANT: int = 2 * 2**20
"""The constant part of that bound (4096 empty tensors are allowed in any payload; a short table is
unpacked in one call)."""
_MAX_ENTRY_BYTES = 1024  # a valid entry takes at most ~620 bytes (a 64-dim shape of uint64 values)
_STREAM_FROM = 16384  # longer tables are read entry by entry
_ENTRY_LIMITS = {  # in a valid entry: a dtype name, at most 64 dims; maps, bins and exts never
    "max_str_len": 64,
    "max_bin_len": 64,
    "max_ext_len": 64,
    "max_array_len": _MAX_NDIM + 1,  # (a 65-dim shape is read, to be named a bad shape)
    "max_map_len": _MAX_NDIM + 1,
}


def _entries(raw: memoryview) -> Iterable[Any]:
    """The entries of the tensor table ``raw``: a list when it is short, else read one by one as they are
    iterated. PayloadError when ``raw`` is not an array, or an entry cannot be unpacked or (a long table)
    is longer than any valid one."""
    if len(raw) < _STREAM_FROM:
        try:
            size = len(raw)
            entries = msgpack.unpackb(
                raw, raw=False, ext_hook=_no_ext, max_str_len=size, max_bin_len=size, max_ext_len=size
            )
        except PayloadError:
            raise
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
            raise malformed(e) from None
        if type(entries) is not list:
            raise PayloadError(f'malformed header: "t" is a {type(entries).__name__}, expected a list')
        return entries
    _skim(raw)  # skipping builds nothing: how long each entry is, before any is unpacked
    up = msgpack.Unpacker(None, max_buffer_size=len(raw), raw=False, ext_hook=_no_ext, **_ENTRY_LIMITS)
    up.feed(raw)
    try:
        n = up.read_array_header()
    except (ValueError, msgpack.UnpackException):
        raise PayloadError(f'malformed header: "t" is a {_msgpack_kind(raw[0])}, expected a list') from None
    return _stream(up, n)


def _stream(up: msgpack.Unpacker, n: int) -> Iterator[Any]:
    """The next ``n`` values of ``up``, one at a time (unpack errors as PayloadError)."""
    for i in range(n):
        try:
            entry = up.unpack()
        except PayloadError:
            raise
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
            raise malformed(e, f"malformed header: tensor {i}") from None
        yield entry


def _skim(raw: memoryview) -> None:
    """Raise PayloadError when an entry of the table ``raw`` is longer than any valid one; leaves every
    other fault to the entry's reading."""
    skim = msgpack.Unpacker(None, max_buffer_size=len(raw))
    skim.feed(raw)
    i, length = -1, 0
    with contextlib.suppress(ValueError, msgpack.UnpackException):  # (reported where the entry is read)
        n = skim.read_array_header()
        skip, tell = skim.skip, skim.tell
        start = tell()
        for index in range(n):
            skip()
            length = tell() - start
            if length > _MAX_ENTRY_BYTES:
                i = index
                break
            start += length
    if length > _MAX_ENTRY_BYTES:
        raise PayloadError(
            f"tensor {i}: its entry takes {length} bytes, more than any valid [dtype, shape, offset, nbytes, device] "
            f"({_MAX_ENTRY_BYTES})"
        )


def _msgpack_kind(first: int) -> str:
    """The Python type a msgpack value starting with byte ``first`` decodes to (for messages)."""
    if first <= 0x7F or first >= 0xE0 or 0xCC <= first <= 0xD3:
        return "int"
    if first <= 0x8F or first in (0xDE, 0xDF):
        return "dict"
    if first <= 0x9F or first in (0xDC, 0xDD):
        return "list"
    if first <= 0xBF or 0xD9 <= first <= 0xDB:
        return "str"
    return {0xC0: "NoneType", 0xC2: "bool", 0xC3: "bool", 0xCA: "float", 0xCB: "float"}.get(
        first, "bytes" if 0xC4 <= first <= 0xC6 else "msgpack ext or reserved value"
    )


def _read_table(raw: memoryview, header_end: int, total_len: int, version: int) -> tuple[Slot, ...]:
    """Read the table ``raw``, checking each entry against the payload's bounds as it comes (see
    TABLE_BYTES_PER_BYTE); in table order. A version 1 entry has no device (its tensor was on the CPU)."""
    width = 4 if version == 1 else 5  # version 2 adds the device
    slots: list[Slot] = []
    data_end = header_end
    # Decoding costs memory per tensor (a slot here, a tensor object later). Non-empty tensors occupy
    # at least 64 payload bytes each (alignment), empty ones none: bound those, so that decoding never
    # costs more than a small multiple of the payload's size.
    empty_left = _MAX_EMPTY_TENSORS + total_len // ALIGN
    full_left = max(0, total_len - align(header_end) + ALIGN - 1) // ALIGN  # distinct aligned starts
    prev_end, in_order = 0, True
    for i, entry in enumerate(_entries(raw)):
        if type(entry) is not list or len(entry) != width:
            fields = "dtype, shape, offset, nbytes" + (", device" if width == 5 else "")
            raise PayloadError(f"tensor {i}: entry {short_repr(entry, 100)} is not [{fields}]")
        name, shape, offset, nbytes = entry[:4]
        where = entry[4] if width == 5 else "cpu"
        if type(where) is not str or not _is_device_name(where):
            raise PayloadError(
                f"tensor {i}: bad device {short_repr(where, 60)}; expected a device as str(tensor.device) "
                "writes it ('cpu', 'cuda:1', 'meta')"
            )
        dtype = DTYPE_BY_NAME.get(name) if type(name) is str else None
        if dtype is None:
            raise PayloadError(
                f"tensor {i}: unknown dtype {short_repr(name, 60)}; expected one of {', '.join(DTYPE_BY_NAME)}"
            )
        if (
            type(shape) is not list
            or len(shape) > _MAX_NDIM
            or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)
        ):
            raise PayloadError(
                f"tensor {i}: bad shape {short_repr(shape, 100)}; expected a list of at most {_MAX_NDIM} "
                f"ints in [0, 2**63)"
            )
        if type(offset) is not int or type(nbytes) is not int:
            raise PayloadError(
                f"tensor {i}: offset {short_repr(offset, 40)} and nbytes {short_repr(nbytes, 40)} must be ints"
            )
        numel = math.prod(shape)
        expected = 0 if where == "meta" else numel * dtype.itemsize  # a meta tensor has no bytes
        if expected == 0:
            empty_left -= 1
            if empty_left < 0:
                raise PayloadError(
                    f"more than {_MAX_EMPTY_TENSORS + total_len // ALIGN} empty tensors in a payload of "
                    f"{total_len} bytes: refused (a crafted payload; a real config with that many empty "
                    "tensors must store them differently)"
                )
        if nbytes != expected:
            raise PayloadError(
                f"tensor {i}: nbytes {nbytes} != "
                + (
                    "0: a meta tensor has no bytes,"
                    if where == "meta"
                    else f"{numel} elements x {dtype.itemsize} bytes"
                )
                + f" for {name} of shape {shape}"
            )
        if offset % ALIGN:
            raise PayloadError(f"tensor {i}: offset {offset} is not a multiple of {ALIGN}")
        if offset < header_end:
            raise PayloadError(
                f"tensor {i}: offset {offset} overlaps the header, which ends at byte {header_end}"
            )
        if offset + nbytes > total_len:
            raise PayloadError(
                f"tensor {i}: bytes {offset}..{offset + nbytes} run past the payload's end at {total_len}"
            )
        data_end = max(data_end, offset + nbytes)
        strides = _strides(shape) if nbytes else _NO_STRIDES
        slots.append(Slot(offset, nbytes, dtype, shape, strides, where))
        if nbytes:
            full_left -= 1
            if full_left < 0:  # more than the bytes after the header hold apart: two of them overlap
                _refuse_overlaps(slots)
            in_order = in_order and offset >= prev_end
            prev_end = offset + nbytes
    if data_end != total_len:
        raise PayloadError(
            f"payload length {total_len} does not match the end of its content at byte {data_end}; "
            "expected them equal (corrupt length or header)"
        )
    if not in_order:  # encode writes tensors in offset order; another order is checked here
        _refuse_overlaps(slots)
    return tuple(slots)


def _refuse_overlaps(slots: list[Slot]) -> None:
    """Raise PayloadError naming two non-empty tensors of ``slots`` whose bytes overlap, if any do."""
    order = [i for i, s in enumerate(slots) if s.nbytes]
    order.sort(key=lambda i: slots[i].offset)  # (indices: less memory than tuples of a crafted table)
    prev_end, prev = 0, -1
    for i in order:
        offset, nbytes = slots[i].offset, slots[i].nbytes
        if offset < prev_end:
            raise PayloadError(
                f"tensors {prev} and {i} overlap (byte {offset} < {prev_end}); expected disjoint ranges"
            )
        prev_end, prev = offset + nbytes, i


@functools.lru_cache(maxsize=64)
def _is_device_name(name: str) -> bool:
    """Whether ``name`` is a device as ``str(tensor.device)`` writes it (whether or not it exists here)."""
    if len(name) > 64:
        return False
    try:
        return str(torch.device(name)) == name
    except (RuntimeError, TypeError, ValueError):
        return False


_NO_STRIDES: list[
    int
] = []  # an empty tensor's slot: made with torch.empty, no strides needed (never changed)


def _strides(shape: list[int]) -> list[int]:
    """Row-major strides (in elements) of a contiguous tensor of ``shape``."""
    strides, step = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = step
        step *= max(shape[d], 1)
    return strides
