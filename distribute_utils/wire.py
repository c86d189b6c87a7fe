"""Wire format: one self-describing byte string per rank per gather round.

A payload is a fixed 32-byte prefix, a msgpack header holding the config tree (with
tensors replaced by references) and one entry per tensor, then the raw tensor bytes,
each tensor at an offset that is a multiple of :data:`ALIGN` (64). The exact length is
known before anything is written, so shared-memory segments and files are sized
exactly. Decoding never unpickles and returns tensors that are zero-copy
``torch.frombuffer`` views of the caller's buffer. The full specification is
``docs/wire-format.md``; the byte-exact test in ``tests/test_wire.py`` pins it.

Typical use::

    payload = encode({"scale": 0.5, "w": weight}, checksum=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, payload.nbytes)              # sized exactly
    payload.write_to_fd(fd)                       # or payload.write_into(a writable buffer)
    ...
    config = decode(mmap.mmap(fd, payload.nbytes))  # on the reading rank: views of the map
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import enum
import functools
import math
import os
import reprlib
import struct
import sys
import types
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import msgpack
import torch

from .caches import Recent
from .errors import ArgumentError, DeviceUnavailableError, PayloadError, SpaceError, UnsupportedTypeError

__all__ = [
    "ALIGN",
    "DEFAULT_MAX_HEADER_BYTES",
    "DTYPE_BY_NAME",
    "EXT_BIGINT",
    "EXT_DATACLASS",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "FLAG_CHECKSUM",
    "MAGIC",
    "MAX_DEPTH",
    "PREFIX_SIZE",
    "READABLE_VERSIONS",
    "SOURCE_DEVICE",
    "SUPPORTED_DTYPES",
    "TABLE_BYTES_CONSTANT",
    "TABLE_BYTES_PER_BYTE",
    "VERSION",
    "EncodedPayload",
    "PayloadPrefix",
    "as_uint8",
    "decode",
    "decode_split",
    "encode",
    "head_known",
    "nesting_error",
    "pwrite_all",
    "read_prefix",
    "stated_length",
    "tensor_buffer",
    "unusable_device",
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

_PREFIX = struct.Struct("<4sHHQQQ")
_VERSION_FIELD = struct.Struct("<H")  # the prefix's version field, at byte 4
_LENGTH = struct.Struct("<Q")  # the prefix's header length and total length fields (at these offsets)
_HEADER_LEN_AT, _TOTAL_LEN_AT = 8, 16
assert _PREFIX.size == PREFIX_SIZE
_KNOWN_FLAGS = FLAG_CHECKSUM
_MIN_HEADER = 7  # b"\x82\xa1v\xc0\xa1t\x90" == {"v": None, "t": []}
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1
_MAX_NDIM = 64
_MAX_EMPTY_TENSORS = 4096  # plus one per 64 payload bytes (see _build_tensors)
_MAX_DIM = 2**63 - 1
_ZEROS = bytes(ALIGN)
_FEW_TENSORS = 2  # payloads with at most this many tensors view each with its own frombuffer
_MAX_WRITE = 2**30  # split writes larger than 1 GiB
_COPY_CHUNK = 2**28  # a copy holds the GIL: 256 MiB (~25 ms) at a time (smaller pieces copy slower)
try:
    _IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
    _IOV_MAX = 16
_TUPLE_EXT = msgpack.ExtType(EXT_TUPLE, b"")
_DATACLASS_EXT = msgpack.ExtType(EXT_DATACLASS, b"")
_TYPED_EXT = msgpack.ExtType(EXT_TYPED, b"")


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
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(DTYPE_BY_NAME)
"""Names of the dtypes a payload may carry (``str(dtype)`` without the ``torch.`` prefix)."""

# Same-itemsize dtypes with copy kernels everywhere: sub-byte shells (int4, uint3, ...) and
# float8 kinds lack some kernels, so strided copies go through a bit-identical view.
_CARRIERS: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
    16: torch.complex128,
}

_PLAIN = frozenset({str, float, bool, bytes, type(None)})
_SUPPORTED_TEXT = (
    "supported: None, bool, int, float, str, bytes, list, tuple, dict with str/int keys, "
    "OrderedDict, enum members, numpy scalars and arrays (bool, int, float, complex), "
    "dataclass instances and torch.Tensor"
)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _type_name(tp: type) -> str:
    module = getattr(tp, "__module__", None)
    name = getattr(tp, "__qualname__", repr(tp))
    return name if module in (None, "builtins") else f"{module}.{name}"


def _bytes_view(buf: Any) -> memoryview:
    """A flat, byte-format memoryview of ``buf`` (bytes, bytearray, mmap, memoryview, ndarray...)."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise UnsupportedTypeError(
            f"expected a bytes-like object (bytes, bytearray, memoryview, mmap), got {_type_name(type(buf))}"
        ) from None
    if mv.ndim != 1 or mv.format != "B":
        if not mv.c_contiguous:
            raise UnsupportedTypeError("the payload buffer must be C-contiguous")
        mv = mv.cast("B")
    return mv


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype; the tensor must outlive it).

    ctypes over ``data_ptr`` costs about 0.5 us per tensor, a quarter of the
    ``t.view(torch.uint8).numpy()`` route, and works for every dtype incl. bfloat16/float8.
    """
    return memoryview((ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())).cast("B")


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's bytes, any dtype (a copy only when it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def pwrite_all(fd: int, bufs: Iterable[memoryview], offset: int) -> None:
    """Writes ``bufs`` back to back at ``offset`` of ``fd``: the one write loop of the package.

    ``os.pwritev`` (one system call for many small buffers; plain ``pwrite`` where it does not exist),
    at most 1 GiB and ``IOV_MAX`` buffers per call, looping on short writes; the file offset of ``fd``
    does not move. ``fd`` must not be opened with ``O_APPEND`` (Linux then ignores the offset).

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``) or made no progress.
    """
    segs = [b for b in bufs if b.nbytes]
    pos = offset
    i = 0
    pwritev = getattr(os, "pwritev", None)
    while i < len(segs):
        batch: list[memoryview] = []
        size = 0
        j = i
        while j < len(segs) and len(batch) < _IOV_MAX and size < _MAX_WRITE:
            seg = segs[j]
            room = _MAX_WRITE - size
            if seg.nbytes > room:
                batch.append(seg[:room])
                size += room
                break
            batch.append(seg)
            size += seg.nbytes
            j += 1
        # os.pwritev exists on Linux, the BSDs and macOS >= 11; plain pwrite elsewhere.
        written = pwritev(fd, batch, pos) if pwritev is not None else os.pwrite(fd, batch[0], pos)
        if written <= 0:
            raise SpaceError(
                f"pwritev wrote {written} of {size} bytes at offset {pos} of fd {fd}: the file takes no more "
                "(is its filesystem full?)"
            )
        pos += written
        while i < len(segs) and written >= segs[i].nbytes:
            written -= segs[i].nbytes
            i += 1
        if written:
            segs[i] = segs[i][written:]


_RECENT_MAX = 256  # layouts and headers kept
_RECENT_BYTES_MAX = 1 << 16  # larger keys are worked out every time rather than kept


def _crc(segments: Iterable[memoryview], value: int = 0) -> int:
    for seg in segments:
        value = zlib.crc32(seg, value)
    return value


# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True, eq=False)
class EncodedPayload:
    """A payload ready to be written: exact length, leading bytes and tensor chunks.

    The bytes ``[0, nbytes)`` are ``head`` followed by each chunk's bytes at its offset,
    with zero bytes in every gap (always fewer than :data:`ALIGN`).

    Attributes:
        nbytes: exact total length of the payload in bytes.
        head: prefix + msgpack header + zero padding up to the first chunk's offset
            (the whole payload when there is no chunk).
        chunks: ``(offset, tensor)`` pairs in increasing offset order; each tensor is a
            contiguous CPU tensor whose bytes go at ``offset``. Empty tensors have no chunk.
    """

    nbytes: int
    head: bytes
    chunks: tuple[tuple[int, torch.Tensor], ...] = ()
    _cache: dict[str, tuple[memoryview, ...]] = dataclasses.field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    @property
    def _segments(self) -> tuple[memoryview, ...]:
        """Byte views covering the whole payload (needs every chunk on the CPU)."""
        found = self._cache.get("segments")
        if found is None:
            found = self._cache["segments"] = (
                memoryview(self.head),
                *_segments_after(len(self.head), self.chunks, self.nbytes),
            )
        return found

    @property
    def device_resident(self) -> bool:
        """Whether every tensor chunk lives on an accelerator (there is at least one chunk)."""
        return bool(self.chunks) and all(t.device.type != "cpu" for _, t in self.chunks)

    def to_cpu(self) -> EncodedPayload:
        """The same payload with every chunk on the CPU (``self`` when they already are)."""
        if all(t.device.type == "cpu" for _, t in self.chunks):
            return self
        return EncodedPayload(
            self.nbytes, self.head, tuple((o, _contiguous(t, False)) for o, t in self.chunks)
        )

    @property
    def on_device(self) -> bool:
        """Whether any tensor chunk lives on an accelerator: :meth:`write_into` copies it from there into
        the buffer (one device-to-host copy); every other writer needs :meth:`to_cpu` first."""
        return any(not t.is_cpu for _, t in self.chunks)

    def write_to_fd(self, fd: int, base: int = 0) -> None:
        """Write the payload at byte ``base`` of an open file descriptor.

        Uses ``os.pwritev`` (one system call for many small tensors), at most
        1 GiB and ``IOV_MAX`` buffers per call, and loops on short writes. Tensor bytes are
        passed to the kernel without an extra copy. The file offset of ``fd`` is not moved.
        Padding is written too, so the target need not be zeroed first.

        Args:
            fd: a file descriptor open for writing (a file, a shared-memory segment), not
                with ``O_APPEND`` (Linux then ignores the offset of ``pwrite``).
            base: where the payload's byte 0 goes.

        Raises:
            OSError: the write failed (e.g. ``ENOSPC``) or made no progress.
        """
        pwrite_all(fd, self._segments, base)

    def write_into(self, buf: memoryview | bytearray | Any) -> None:
        """Copy the payload into the first :attr:`nbytes` bytes of a writable buffer.

        Padding is written as zeros, so the buffer need not be zeroed first. A plain copy holds the
        GIL: it goes 256 MiB at a time, so that other threads run between the pieces. A chunk on a GPU
        is copied from there straight into the buffer (at pinned speed where the buffer is registered,
        see :mod:`.transports.pinning`), and the copies are complete when this returns.

        Args:
            buf: a writable bytes-like object (bytearray, memoryview, mmap) of at least
                :attr:`nbytes` bytes.

        Raises:
            TypeError: ``buf`` is read-only or not bytes-like.
            ValueError: ``buf`` is shorter than :attr:`nbytes`.
        """
        with _bytes_view(buf) as mv:  # released on exit, so an mmap can be closed right after
            if mv.readonly:
                raise UnsupportedTypeError(
                    "write_into needs a writable buffer (bytearray, writable mmap, memoryview)"
                )
            if mv.nbytes < self.nbytes:
                raise ArgumentError(
                    f"buffer of {mv.nbytes} bytes is too small for a payload of {self.nbytes} bytes"
                )
            if self.on_device:
                _write_from_devices(mv, self.head, self.chunks, self.nbytes)
                return
            pos = 0
            for seg in self._segments:
                _copy_in(mv, pos, seg)
                pos += seg.nbytes

    def to_bytes(self) -> bytes:
        """The whole payload as one ``bytes`` object (one copy)."""
        return b"".join(self._segments)

    def buffers(self) -> tuple[memoryview, ...]:
        """Byte views covering the whole payload, in order, padding included: for a gathering write
        (``sendmsg``, ``pwritev``) with no copy. Needs every chunk on the CPU."""
        return self._segments

    def with_checksum(self) -> EncodedPayload:
        """The same payload with its CRC-32 set (``self`` when it already carries one).

        For a payload encoded without a checksum that must now travel where bytes can go
        stale (a network filesystem): one read of the tensor bytes, no re-encoding.
        """
        _, _, flags, header_len, total, _ = _PREFIX.unpack_from(self.head)
        if flags & FLAG_CHECKSUM:
            return self
        body = self.head[PREFIX_SIZE:]
        crc = _crc(_segments_after(len(self.head), self.chunks, total), zlib.crc32(body))
        head = _PREFIX.pack(MAGIC, VERSION, flags | FLAG_CHECKSUM, header_len, total, crc) + body
        return EncodedPayload(self.nbytes, head, self.chunks)


def _copy_in(mv: memoryview, pos: int, data: memoryview) -> None:
    """Copy host bytes ``data`` into ``mv`` at ``pos``, :data:`_COPY_CHUNK` at a time."""
    for start in range(0, data.nbytes, _COPY_CHUNK):
        piece = data[start : start + _COPY_CHUNK]
        mv[pos + start : pos + start + piece.nbytes] = piece


def _write_from_devices(
    mv: memoryview, head: bytes, chunks: tuple[tuple[int, torch.Tensor], ...], nbytes: int
) -> None:
    """:meth:`EncodedPayload.write_into` for chunks on devices: each copied device to host into its place
    (asynchronously on its device's current stream, which is then waited for), padding zeroed. Each GPU
    is synchronised first: a tensor written on another stream is final before it is copied."""
    for device in {t.device for _, t in chunks if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)
    mv[: len(head)] = head
    pos, streams = len(head), {}
    try:
        for offset, tensor in chunks:
            if offset > pos:
                mv[pos:offset] = _zeros(offset - pos)
            size = tensor.numel() * tensor.element_size()
            if tensor.is_cpu:
                _copy_in(mv, offset, _tensor_bytes(tensor))
            else:
                into = torch.frombuffer(mv, dtype=torch.uint8, count=size, offset=offset)
                into.copy_(as_uint8(tensor), non_blocking=tensor.device.type == "cuda")
                del into  # (a view of ``mv``: the caller releases it)
                if tensor.device.type == "cuda":
                    streams[tensor.device] = torch.cuda.current_stream(tensor.device)
            pos = offset + size
        if pos < nbytes:
            mv[pos:nbytes] = _zeros(nbytes - pos)
    finally:
        for stream in streams.values():  # (also after a failure: no copy may land in a buffer let go)
            stream.synchronize()


def _segments_after(pos: int, chunks: tuple[tuple[int, torch.Tensor], ...], nbytes: int) -> list[memoryview]:
    """Byte views covering ``[pos, nbytes)``: zero padding and chunk bytes in order."""
    out = []
    for offset, tensor in chunks:
        if not (tensor.is_cpu and tensor.is_contiguous()):
            raise ArgumentError(f"chunk at offset {offset} must be a contiguous CPU tensor")
        if offset < pos:
            raise ArgumentError(f"chunk at offset {offset} overlaps the previous bytes ending at {pos}")
        if offset > pos:
            out.append(_zeros(offset - pos))
        view = _tensor_bytes(tensor)
        out.append(view)
        pos = offset + view.nbytes
    if pos > nbytes:
        raise ArgumentError(f"payload content ends at byte {pos}, past its stated length {nbytes}")
    if pos < nbytes:
        out.append(_zeros(nbytes - pos))
    return out


def _zeros(n: int) -> memoryview:
    return memoryview(_ZEROS)[:n] if n <= ALIGN else memoryview(bytes(n))


def _path_text(root: str, path: Sequence[Any]) -> str:
    """A path in a config tree as a Python expression: ``path`` holds an int per sequence index, a 1-tuple
    per dict key and a str per dataclass field (``config['layers'][3].act_fn``)."""
    parts = [root]
    for seg in path:
        if type(seg) is int:
            parts.append(f"[{seg}]")
        elif type(seg) is tuple:
            parts.append(f"[{seg[0]!r}]")
        else:
            parts.append(f".{seg}")
    return "".join(parts)


_PATH_ENDS = 5  # a path of more steps than twice this shows its first and last few, with a count between


def _short_path(root: str, path: Sequence[Any]) -> str:
    """:func:`_path_text`, with the middle of a long path left out (a path 200 containers deep)."""
    if len(path) <= 2 * _PATH_ENDS:
        return _path_text(root, path)
    left_out = len(path) - 2 * _PATH_ENDS
    return f"{_path_text(root, path[:_PATH_ENDS])}...({left_out} more)...{_path_text('', path[-_PATH_ENDS:])}"


def _too_deep_error(root: str, path: Sequence[Any], obj: object) -> UnsupportedTypeError:
    return UnsupportedTypeError(
        f"{_short_path(root, path)}: containers nested deeper than {MAX_DEPTH} levels: this "
        f"{_type_name(type(obj))} is at level {len(path) + 1}, past the limit of {MAX_DEPTH} (wire.MAX_DEPTH) "
        "that every rank applies; flatten the config (e.g. a dict keyed by path) before gathering it"
    )


def _cycle_error(root: str, path: Sequence[Any], obj: object, first: Sequence[Any]) -> UnsupportedTypeError:
    return UnsupportedTypeError(
        f"{_short_path(root, path)}: reference cycle: this {_type_name(type(obj))} is the object at "
        f"{_short_path(root, first)}, which contains it; break the cycle before encoding"
    )


def nesting_error(root: str, path: Sequence[Any], containers: Sequence[object]) -> UnsupportedTypeError:
    """The ``TypeError`` :func:`encode` raises for containers nested deeper than :data:`MAX_DEPTH` or in a
    reference cycle, for code that walks a config tree without encoding it (the first rank's own value).

    Args:
        root: the tree's name in the message (``"config"``).
        path: the steps from the root to the last container: an int per list/tuple index, a 1-tuple
            ``(key,)`` per dict key, a str per dataclass field.
        containers: the containers along ``path``, the root's first: ``containers[i]`` is reached by
            ``path[:i]``. The last one is the one found too deep, unless one of them repeats an
            earlier one (then the message names the cycle).
    """
    seen: dict[int, int] = {}
    for depth, obj in enumerate(containers):
        first = seen.setdefault(id(obj), depth)
        if first != depth:
            return _cycle_error(root, path[:depth], obj, path[:first])
    return _too_deep_error(root, path, containers[-1] if containers else None)


class _Encoder:
    """Turns a config tree into msgpack-native values, collecting tensors and checking types."""

    __slots__ = ("_active", "_ids", "_keep", "_path", "_root", "devices", "keep_device", "tensors")

    def __init__(self, root: str, keep_device: bool = False) -> None:
        self._root = root
        self.keep_device = keep_device
        self._path: list[Any] = []  # int: sequence index; (key,): dict key; str: dataclass field
        self._active: dict[int, int] = {}  # id of each container on the current path -> its depth
        self._ids: dict[int, int] = {}  # id(tensor) -> index in self.tensors
        self._keep: list[torch.Tensor] = []  # keep the originals alive so their ids stay unique
        self.tensors: list[torch.Tensor] = []
        self.devices: list[str] = []  # each tensor's device at its sender (see _device_name)

    def path(self, depth: int | None = None) -> str:
        return _path_text(self._root, self._path[:depth])

    def _enter(self, obj: object) -> None:
        key = id(obj)
        if key in self._active:
            raise _cycle_error(self._root, self._path, obj, self._path[: self._active[key]])
        if len(self._active) >= MAX_DEPTH:
            raise _too_deep_error(self._root, self._path, obj)
        self._active[key] = len(self._path)

    def walk(self, obj: object) -> Any:
        tp = type(obj)
        if tp in _PLAIN:
            return obj
        if tp is int:
            if _I64_MIN <= obj <= _U64_MAX:  # type: ignore[operator]
                return obj
            return msgpack.ExtType(EXT_BIGINT, _int_to_bytes(obj))  # type: ignore[arg-type]
        path = self._path
        if tp is list or tp is tuple:
            self._enter(obj)
            items: list[Any] = [] if tp is list else [_TUPLE_EXT]  # a tuple is a marked array
            append = items.append
            for i, item in enumerate(cast("Sequence[Any]", obj)):
                ti = type(item)
                if ti in _PLAIN or (ti is int and _I64_MIN <= item <= _U64_MAX):  # fast path
                    append(item)
                    continue
                path.append(i)
                append(self.walk(item))
                path.pop()
            del self._active[id(obj)]
            return items
        if tp is dict:
            self._enter(obj)
            out = {}
            for key, value in obj.items():  # type: ignore[attr-defined]
                tk = type(key)
                wkey = key
                if tk is not str:
                    if tk is not int:
                        raise UnsupportedTypeError(
                            f"{self.path()}: dict key {key!r:.60} of type {_type_name(tk)} is not "
                            "supported; keys must be str or int"
                        )
                    if not _I64_MIN <= key <= _U64_MAX:
                        wkey = msgpack.ExtType(EXT_BIGINT, _int_to_bytes(key))
                tv = type(value)
                if tv in _PLAIN or (tv is int and _I64_MIN <= value <= _U64_MAX):
                    out[wkey] = value
                    continue
                path.append((key,))
                out[wkey] = self.walk(value)
                path.pop()
            del self._active[id(obj)]
            return out
        if isinstance(obj, torch.Tensor):
            return _tensor_ref(self._tensor(obj))
        if dataclasses.is_dataclass(tp):
            return self._dataclass(obj, tp)
        typed = self._typed(obj, tp)
        if typed is not None:
            return typed
        raise UnsupportedTypeError(
            f"{self.path()}: cannot encode a value of type {_type_name(tp)}; {_SUPPORTED_TEXT}{_hint(tp)}"
        )

    def _typed(self, obj: Any, tp: type) -> list[Any] | None:
        """Enum members, ``OrderedDict`` and numpy values (as ``torch.save`` / JSON carry them)."""
        if isinstance(obj, enum.Enum):
            module, qualname = tp.__module__, tp.__qualname__
            if "<" in qualname:
                raise UnsupportedTypeError(
                    f"{self.path()}: enum {module}.{qualname} is defined inside a function"
                )
            return [_TYPED_EXT, "enum", module, qualname, self.walk(obj.value)]
        if tp is collections.OrderedDict:
            return [_TYPED_EXT, "odict", self.walk(dict(obj))]
        if tp.__module__ == "numpy":
            import numpy as np  # already imported: the value is one of its objects

            if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
                return [_TYPED_EXT, "np", obj.dtype.str, obj.tobytes()]
            if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc" and obj.dtype.byteorder in "=|<":
                tensor = torch.from_numpy(np.ascontiguousarray(obj))
                return [_TYPED_EXT, "ndarray", _tensor_ref(self._tensor(tensor))]
        return None

    def _dataclass(self, obj: object, tp: type) -> list[Any]:
        module, qualname = tp.__module__, tp.__qualname__
        if "<" in qualname:
            raise UnsupportedTypeError(
                f"{self.path()}: dataclass {module}.{qualname} is defined inside a function, so the "
                "reading rank cannot look it up; define it at module level"
            )
        self._enter(obj)
        fields = {}
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            self._path.append(f.name)
            try:
                value = getattr(obj, f.name)
            except AttributeError:
                raise UnsupportedTypeError(f"{self.path()}: dataclass field is not set") from None
            fields[f.name] = self.walk(value)
            self._path.pop()
        del self._active[id(obj)]
        return [_DATACLASS_EXT, module, qualname, fields]

    def _tensor(self, t: torch.Tensor) -> int:
        index = self._ids.get(id(t))
        if index is not None:
            return index
        index = len(self.tensors)
        self.tensors.append(_plain_tensor(t, self.keep_device, self.path))
        self.devices.append(_device_name(t))
        self._ids[id(t)] = index
        self._keep.append(t)
        return index


def _plain_tensor(t: torch.Tensor, keep_device: bool, path: Callable[[], str]) -> torch.Tensor:
    """``t`` as it travels (see :func:`_contiguous`), once checked to be a kind the format carries
    (``path()`` names it in the error)."""
    tp = type(t)
    if tp is not torch.Tensor and tp is not torch.nn.Parameter:
        raise UnsupportedTypeError(
            f"{path()}: tensor subclass {_type_name(tp)} is not supported; pass a plain "
            "torch.Tensor (e.g. .full_tensor() for a DTensor, .as_subclass(torch.Tensor))"
        )
    if t.layout != torch.strided:
        raise UnsupportedTypeError(
            f"{path()}: tensor layout {t.layout} is not supported; call .to_dense() first"
        )
    if t.dtype not in _DTYPE_NAMES:
        raise UnsupportedTypeError(
            f"{path()}: tensor dtype {t.dtype} is not supported (quantized tensors carry "
            "scales the format does not store); use .int_repr() and send the scales separately"
        )
    if t.is_meta:  # no data: it travels as its dtype and shape, and decodes as a meta tensor
        return t.detach()
    return _contiguous(t, keep_device)


def _device_name(t: torch.Tensor) -> str:
    """The device a tensor's entry names: ``str(t.device)`` (``"cpu"``, ``"cuda:1"``, ``"meta"``)."""
    return "cpu" if t.is_cpu else str(t.device)


_BUILTIN_BASES = (bool, int, float, str, bytes, dict, list, tuple)


def _hint(tp: type) -> str:
    for base in _BUILTIN_BASES:
        if issubclass(tp, base):
            return (
                "; subclasses of built-ins are rejected so they cannot change type silently: "
                f"convert with {base.__name__}(value)"
            )
    if issubclass(tp, (bytearray, memoryview)):
        return "; use bytes(value)"
    if issubclass(tp, (set, frozenset)):
        return "; use a sorted list or tuple"
    return ""


def _int_to_bytes(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_TENSOR_REFS = [msgpack.ExtType(EXT_TENSOR, _pack(i)) for i in range(256)]
_LONE_TREE = _pack(_TENSOR_REFS[0])  # a payload that is one tensor (``get_tensors_parallel``)


def _tensor_ref(index: int) -> msgpack.ExtType:
    """The tree's reference to tensor ``index`` (the first ones made once)."""
    return _TENSOR_REFS[index] if index < 256 else msgpack.ExtType(EXT_TENSOR, _pack(index))


def _contiguous(t: torch.Tensor, keep_device: bool) -> torch.Tensor:
    """A contiguous tensor outside autograd with only ``t``'s elements (never its base storage).

    On the CPU, unless ``keep_device`` leaves it on its accelerator.
    """
    # Few calls into torch: each costs microseconds when its caches are cold, as they are
    # every round (the rank slept in a store wait while others ran).
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_contiguous() and (keep_device or t.is_cpu):
        return t
    dtype = t.dtype
    carrier = _CARRIERS.get(t.element_size(), dtype)
    c = t.view(carrier) if carrier != dtype else t
    c = c.contiguous()
    if c.device.type != "cpu" and not keep_device:
        c = c.to("cpu")
    return c.view(dtype) if carrier != dtype else c


def encode(
    obj: object, *, root: str = "config", checksum: bool = False, keep_device: bool = False
) -> EncodedPayload:
    """Encode a config tree (with tensors anywhere in it) into a payload.

    Tensors are detached, made contiguous (only a view's own elements are stored, never its
    base storage) and copied to CPU when on another device; a CPU tensor that is already
    contiguous is referenced, not copied, so do not modify it before the payload is written.
    The same tensor object appearing twice is stored once and decodes as one tensor.

    Args:
        obj: the config tree: None, bool, int (any size), float, str, bytes, list, tuple,
            dict with str/int keys, dataclass instances and ``torch.Tensor`` (incl.
            ``nn.Parameter``, which decodes as a plain tensor), and what ``torch.save`` / JSON
            carry for ModelOpt: ``OrderedDict``, ``enum.Enum`` / ``IntEnum`` members and numpy
            scalars and arrays, which decode as the same types (an enum or dataclass only when
            its module is already imported on the reader). Other subclasses of built-ins
            (namedtuple, str subclasses...) are rejected rather than silently changing type.
        root: name of ``obj`` in error messages, e.g. ``config['layers'][3].act_fn``.
        checksum: store the CRC-32 of every byte after the prefix (costs one read of the
            tensor bytes, about 6.7 GB/s).
        keep_device: leave accelerator tensors where they are (for a transport that sends
            from device memory, e.g. NCCL); :meth:`EncodedPayload.to_cpu` moves them later.
            Not together with ``checksum``.

    Returns:
        The payload, with its exact length in :attr:`EncodedPayload.nbytes`.

    Raises:
        TypeError: a value, dict key or tensor kind is not supported, a reference cycle, or
            nesting deeper than :data:`MAX_DEPTH`; the message names the path inside ``obj``.
        ValueError: the non-tensor part encodes to more than :data:`DEFAULT_MAX_HEADER_BYTES`
            (what every reader accepts), raised before anything is written.
    """
    if checksum and keep_device:
        raise ArgumentError("encode: checksum needs the bytes on the CPU; do not combine it with keep_device")
    if type(obj) is torch.Tensor:  # the tree is the one tensor (``get_tensors_parallel``): nothing to walk
        v_bytes, tensors = _LONE_TREE, [_plain_tensor(obj, keep_device, lambda: root)]
        devices = [_device_name(obj)]
        shapes: tuple[tuple[torch.dtype, torch.Size, str], ...] = ((obj.dtype, obj.shape, devices[0]),)
    else:
        enc = _Encoder(root, keep_device)
        tree = enc.walk(obj)
        try:
            v_bytes = _LONE_TREE if tree is _TENSOR_REFS[0] else _pack(tree)
        except UnicodeEncodeError as e:
            raise UnsupportedTypeError(f"{root}: contains a str that is not valid UTF-8 ({e})") from None
        tensors, devices = enc.tensors, enc.devices
        shapes = tuple((t.dtype, t.shape, d) for t, d in zip(tensors, devices))
    small = len(v_bytes) <= _RECENT_BYTES_MAX
    layout = _LAYOUTS.get((v_bytes, shapes)) if small else None
    if layout is None:
        layout = _layout(v_bytes, tensors, devices, root)
        if small:
            _LAYOUTS.put((v_bytes, shapes), layout)
    header_len, offsets, total, body, plain_head = layout
    chunks = tuple(
        (o, t) for o, t, d in zip(offsets, tensors, devices, strict=True) if t.nbytes and d != "meta"
    )
    if not checksum:
        return EncodedPayload(total, plain_head, chunks)
    head_end = chunks[0][0] if chunks else total
    crc = _crc(_segments_after(head_end, chunks, total), zlib.crc32(body))
    return EncodedPayload(
        total, _PREFIX.pack(MAGIC, VERSION, FLAG_CHECKSUM, header_len, total, crc) + body, chunks
    )


_LAYOUTS: Recent[Any, Any] = Recent(_RECENT_MAX)


def _layout(
    v_bytes: bytes, tensors: list[torch.Tensor], devices: list[str], root: str
) -> tuple[int, list[int], int, bytes, bytes]:
    """Where everything of a payload goes: header length, each tensor's offset, the total length, the
    bytes after the prefix up to the first tensor (header and padding), and those with the prefix of a
    payload without a checksum. A pure function of the encoded tree and the tensors' dtypes, shapes and
    devices (:func:`encode` keeps recent ones); a meta tensor takes no bytes."""
    header_base = b"\x82\xa1v" + v_bytes + b"\xa1t"
    # Offsets are absolute, and their msgpack size feeds back into where the data starts:
    # iterate to the fixed point. start(B) never decreases as B grows, so this converges in a
    # few steps from the lower bound.
    start = _align(PREFIX_SIZE + len(header_base) + 1)
    while True:
        entries: list[list[Any]] = []
        cursor = start
        end = 0
        for t, where in zip(tensors, devices):
            nb = 0 if where == "meta" else t.nbytes
            entries.append([_DTYPE_NAMES[t.dtype], list(t.shape), cursor, nb, where])
            end = cursor + nb
            cursor = _align(end)
        header = header_base + _pack(entries)
        header_end = PREFIX_SIZE + len(header)
        new_start = _align(header_end)
        if new_start == start:
            break
        start = new_start
    if len(header) > DEFAULT_MAX_HEADER_BYTES:
        raise ArgumentError(
            f"{root}: its non-tensor part (strings, bytes, numbers, structure) takes {len(header):,} bytes "
            f"encoded, over the limit of {DEFAULT_MAX_HEADER_BYTES:,} that every reader applies; put bulk "
            "data in tensors (e.g. torch.frombuffer(bytearray(data), dtype=torch.uint8))"
        )
    total = end if tensors else header_end
    head_end = next((e[2] for e in entries if e[3]), total)
    body = header + bytes(head_end - header_end)
    return (
        len(header),
        [e[2] for e in entries],
        total,
        body,
        _PREFIX.pack(MAGIC, VERSION, 0, len(header), total, 0) + body,
    )


# --------------------------------------------------------------------------- decoding


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
    with _bytes_view(buf) as mv:  # released before any error, so an mmap can be closed after one
        nbytes = mv.nbytes
        fields = _PREFIX.unpack_from(mv) if nbytes >= PREFIX_SIZE else None
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
    return int(_LENGTH.unpack_from(buf, _TOTAL_LEN_AT)[0])


def decode(
    buf: Any,
    *,
    device: str | torch.device | None = None,
    verify: bool = True,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    root: str = "config",
) -> object:
    """Decode a payload back into its config tree.

    Everything is validated before it is trusted (lengths, checksum, header structure, every
    tensor entry). Tensors are ``torch.frombuffer`` views of ``buf``: no copy, and they keep
    the buffer alive (an ``mmap`` cannot be closed while any of them exists). Tensors over a
    read-only buffer (``bytes``, a read-only mapping) must not be written to. Bytes after
    ``total_len`` are ignored (a segment may be page-rounded).

    Args:
        buf: a bytes-like object holding the payload from byte 0.
        device: where tensors should live; ``None`` or CPU gives zero-copy views, any other
            device copies them there; :data:`SOURCE_DEVICE` puts each on the device its entry
            names, the one its sender had it on, as ``torch.load`` does (CPU ones as views). A
            meta tensor has no bytes: it decodes as a meta tensor of its dtype and shape, always.
        verify: check the checksum when the payload carries one.
        max_header_bytes: refuse headers longer than this.
        root: the tree's name in error messages (``config['layers'][3].weight``).

    Returns:
        The config tree; tuples, int keys, key order and dataclass types as encoded.

    Raises:
        PayloadError: the payload is truncated, corrupt, malformed, from another format
            version, or names a dataclass that cannot be found.
        DeviceUnavailableError: with :data:`SOURCE_DEVICE`, a tensor's device does not exist in
            this process (named with the tensor's path), raised before any tensor is built.
    """
    if isinstance(buf, torch.Tensor):
        _check_flat_bytes(buf, "decode")
        if buf.device.type != "cpu":  # device memory: read its head on the host, tensors are views of it
            head_len = read_prefix(bytes(tensor_buffer(buf[:PREFIX_SIZE].cpu()))).header_len
            head = bytes(tensor_buffer(buf[: PREFIX_SIZE + head_len].cpu()))
            return _decode_checked(head, device, verify, max_header_bytes, buf, root)
        buf = tensor_buffer(buf)
    return _decode_checked(buf, device, verify, max_header_bytes, None, root)


def decode_split(
    head: Any,
    data: torch.Tensor,
    *,
    device: str | torch.device | None = None,
    verify: bool = True,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    root: str = "config",
) -> object:
    """Decode a payload held in two parts: ``head``, a bytes-like host copy of its first bytes through
    the end of its header, and ``data``, the whole payload as a flat uint8 tensor on any device.

    What :func:`decode` does for a tensor in device memory (after copying its head to the host); a
    caller that holds the head on the host already (and tests, with ``data`` on the CPU) call it
    directly. Tensors are views of ``data`` (copies when ``device`` names another device); a payload
    carrying a checksum is refused (its bytes are not on the host to check). Arguments and errors as
    :func:`decode`'s.
    """
    _check_flat_bytes(data, "decode_split")
    return _decode_checked(head, device, verify, max_header_bytes, data, root)


def _check_flat_bytes(buf: torch.Tensor, caller: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise UnsupportedTypeError(
            f"{caller} takes a flat, contiguous uint8 tensor, got dtype {buf.dtype} and shape {tuple(buf.shape)}"
        )


def _decode_checked(
    buf: Any,
    device: str | torch.device | None,
    verify: bool,
    max_header_bytes: int,
    data: torch.Tensor | None,
    root: str,
) -> object:
    """:func:`_decode` of ``buf`` (host bytes: the whole payload, or its head when ``data`` holds it),
    its errors raised afresh once the views of ``buf`` are let go."""
    mv = _bytes_view(buf)
    try:
        return _decode(mv, device, verify, max_header_bytes, data, root)
    except (PayloadError, DeviceUnavailableError) as e:
        error = type(e)(*e.args)
    # The failed attempt's frames (and any views or tensors they held) died with the traceback
    # above; release our view too, so the caller can close an mmap in its ``except`` block.
    with contextlib.suppress(BufferError):
        mv.release()
    raise error


def _decode(
    mv: memoryview,
    device: str | torch.device | None,
    verify: bool,
    max_header_bytes: int,
    data: torch.Tensor | None = None,
    root: str = "config",
) -> object:
    # A payload whose first bytes up to its header's end were checked before is taken as they were:
    # every check of the prefix and the header is a pure function of those bytes (the same ones come
    # back round after round). The length, device and checksum checks below run every time.
    key = _head_key(mv, max_header_bytes)
    known = _HEADS.get(key) if key is not None else None
    if known is None:
        flags, header_len, total_len, checksum = read_prefix(mv, max_header_bytes=max_header_bytes)
    else:
        flags, header_len, total_len, checksum, v_span, table, lone = known
    have = mv.nbytes if data is None else data.numel()
    if have < total_len:
        raise PayloadError(f"truncated: payload says {total_len} bytes, got {have}")
    if data is not None and flags & FLAG_CHECKSUM:
        raise PayloadError("a payload in device memory cannot carry a checksum")
    if verify and flags & FLAG_CHECKSUM:
        computed = zlib.crc32(mv[PREFIX_SIZE:total_len])
        if computed != checksum:
            raise PayloadError(
                f"checksum mismatch: prefix says 0x{checksum:08x}, bytes {PREFIX_SIZE}..{total_len} give "
                f"0x{computed:08x}; the payload is corrupt or was only partly written"
            )
    header_end = PREFIX_SIZE + header_len
    if known is None:
        header = mv[PREFIX_SIZE:header_end]
        v_span, t_span = _parse_header(header, header_len)
        (version,) = _VERSION_FIELD.unpack_from(mv, 4)
        table = _tensor_table(header[t_span[0] : t_span[1]], header_end, total_len, version)
        lone = len(table) == 1 and header[v_span[0] : v_span[1]] == _LONE_TREE
        if key is not None and not flags & FLAG_CHECKSUM:  # (a checksum differs every time)
            _HEADS.put(key, (flags, header_len, total_len, checksum, v_span, table, lone))
    source = type(device) is str and device == SOURCE_DEVICE
    missing = _missing_device(table) if source else None
    if data is None and missing is None and len(table) > 1:
        whole = _one_device(table, device)
        if whole is not None:  # one host-to-device copy of the payload; its tensors are views of it
            data = _build_tensors(
                mv, (_Slot(0, total_len, torch.uint8, [total_len], [1], "cpu"),), total_len, whole
            )[0]
    tensors = _build_tensors(mv, table, total_len, None if missing else device, data)
    tree = (
        tensors[0] if lone else _decode_tree(mv[PREFIX_SIZE + v_span[0] : PREFIX_SIZE + v_span[1]], tensors)
    )
    if missing is not None:  # (the tree, with CPU views, only to name the tensor)
        i, why = missing
        raise DeviceUnavailableError(
            f"{_path_to(tree, tensors[i], root)} is on {table[i].device} at its sender, a device this "
            f"process does not have ({why}); torch.load would fail here too: pass device= to put "
            "received tensors on a device this rank has (e.g. device='cpu')"
        )
    return tree


def _one_device(table: tuple[_Slot, ...], device: str | torch.device | None) -> torch.device | None:
    """The one accelerator every tensor with bytes goes to when decoded to ``device``, if there is one."""
    if type(device) is str and device == SOURCE_DEVICE:
        found = {slot.device for slot in table if slot.nbytes and slot.device != "meta"}
        return _torch_device(found.pop()) if len(found) == 1 and "cpu" not in found else None
    if device is None:
        return None
    dev = torch.device(device)
    return None if dev.type in ("cpu", "meta") else dev


def _missing_device(table: tuple[_Slot, ...]) -> tuple[int, str] | None:
    """The first tensor of ``table`` whose device this process does not have, and why."""
    for i, slot in enumerate(table):
        where = slot.device
        if where != "cpu" and where != "meta":
            why = unusable_device(where)
            if why is not None:
                return i, why
    return None


@functools.lru_cache(maxsize=64)
def unusable_device(device: str | torch.device) -> str | None:
    """Why this process cannot hold tensors on ``device`` (as ``torch.load`` would refuse to
    restore them there), or None when it can. Answers are kept: devices do not come and go."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        return _first_line(exc)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            return f"torch.cuda.device_count() is {count}"
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, TypeError, AssertionError) as exc:
        return _first_line(exc)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _path_to(tree: object, target: torch.Tensor, root: str) -> str:
    """Where ``target`` sits in a decoded tree, written as :class:`_Encoder` writes paths."""
    stack: list[tuple[object, str]] = [(tree, root)]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        children: list[tuple[object, str]]
        if isinstance(node, dict):  # (a decoded tree holds dict, OrderedDict, list and tuple exactly)
            children = [(v, f"{path}[{k!r}]") for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(node)]
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            children = [(getattr(node, f.name), f"{path}.{f.name}") for f in dataclasses.fields(node)]
        else:
            continue
        stack.extend(reversed(children))
    return f"a tensor of {root}"


def _head_key(mv: memoryview, max_header_bytes: int) -> bytes | None:
    """A payload's bytes up to its header's end, as stated by its prefix (None when too short to say,
    or too long to keep)."""
    if mv.nbytes < PREFIX_SIZE:
        return None
    (header_len,) = _LENGTH.unpack_from(mv, _HEADER_LEN_AT)
    if header_len > min(max_header_bytes, _RECENT_BYTES_MAX):
        return None
    return mv[: PREFIX_SIZE + header_len].tobytes()


# Checked heads (prefix and header): their bytes -> what they say.
_HEADS: Recent[Any, Any] = Recent(_RECENT_MAX)


def head_known(buf: Any, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> bool:
    """Whether :func:`decode` takes the head (prefix and header) of the payload in ``buf`` as checked
    before, and skips those checks (never the length, device and checksum ones); for tests and
    diagnostics."""
    key = _head_key(_bytes_view(buf), max_header_bytes)
    return key is not None and key in _HEADS


_MSGPACK_DEPTH = 1024  # msgpack's unpacker nests at most this many containers


def _malformed(e: Exception, what: str = "malformed header") -> PayloadError:
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


def _shown(value: Any, limit: int) -> str:
    """``repr(value)`` cut to ``limit`` characters, built without recursing deeper than a few levels or
    reading more than a few items (a crafted header nests arrays up to msgpack's limit of 1024)."""
    return _REPR.repr(value)[:limit]


def _no_ext(code: int, data: bytes) -> Any:
    raise PayloadError(f"unexpected ext type {code} in the tensor table")


def _parse_header(header: memoryview, header_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
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
                shown = _shown(key, 60) if key is not None else f"(a msgpack {_msgpack_kind(header[at])})"
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
        raise _malformed(e) from None
    if used != header_len:
        raise PayloadError(
            f"malformed header: msgpack map ends at byte {used} of a {header_len}-byte header; "
            "expected no trailing bytes"
        )
    return spans["v"], spans["t"]


class _Slot(NamedTuple):
    """One checked tensor entry, ready to build: where its bytes are and what they are."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: list[int]
    strides: list[int]
    device: str  # where its sender had it ("cpu" for a version 1 payload)


# Checked tensor tables: configs differ in values more often than in shapes.
_TABLES: Recent[Any, Any] = Recent(_RECENT_MAX)


def _tensor_table(raw: memoryview, header_end: int, total_len: int, version: int) -> tuple[_Slot, ...]:
    """The checked tensor table of a payload (``raw``: the msgpack bytes of ``"t"``).

    A table is a pure function of its bytes, where the header ends and the payload's length, so
    a table already checked under the same three is reused (the same shapes come back round
    after round): checking costs several microseconds per tensor, a lookup one per payload.
    """
    key = (raw.tobytes(), header_end, total_len, version) if len(raw) <= _RECENT_BYTES_MAX else None
    table = _TABLES.get(key) if key is not None else None
    if table is None:
        table = _read_table(raw, header_end, total_len, version)
        if key is not None:
            _TABLES.put(key, table)
    return table


# Reading a table holds at most TABLE_BYTES_PER_BYTE bytes of Python objects per payload byte, plus
# TABLE_BYTES_CONSTANT, before it is refused or accepted (docs/wire-format.md, section 5). What is kept
# per entry (a _Slot: about 200 bytes for an empty tensor, 270 for another) is bounded by the payload's
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
            raise _malformed(e) from None
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
            raise _malformed(e, f"malformed header: tensor {i}") from None
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


def _read_table(raw: memoryview, header_end: int, total_len: int, version: int) -> tuple[_Slot, ...]:
    """Read the table ``raw``, checking each entry against the payload's bounds as it comes (see
    TABLE_BYTES_PER_BYTE); in table order. A version 1 entry has no device (its tensor was on the CPU)."""
    width = 4 if version == 1 else 5  # version 2 adds the device
    slots: list[_Slot] = []
    data_end = header_end
    # Decoding costs memory per tensor (a slot here, a tensor object later). Non-empty tensors occupy
    # at least 64 payload bytes each (alignment), empty ones none: bound those, so that decoding never
    # costs more than a small multiple of the payload's size.
    empty_left = _MAX_EMPTY_TENSORS + total_len // ALIGN
    full_left = max(0, total_len - _align(header_end) + ALIGN - 1) // ALIGN  # distinct aligned starts
    prev_end, in_order = 0, True
    for i, entry in enumerate(_entries(raw)):
        if type(entry) is not list or len(entry) != width:
            fields = "dtype, shape, offset, nbytes" + (", device" if width == 5 else "")
            raise PayloadError(f"tensor {i}: entry {_shown(entry, 100)} is not [{fields}]")
        name, shape, offset, nbytes = entry[:4]
        where = entry[4] if width == 5 else "cpu"
        if type(where) is not str or not _is_device_name(where):
            raise PayloadError(
                f"tensor {i}: bad device {_shown(where, 60)}; expected a device as str(tensor.device) "
                "writes it ('cpu', 'cuda:1', 'meta')"
            )
        dtype = DTYPE_BY_NAME.get(name) if type(name) is str else None
        if dtype is None:
            raise PayloadError(
                f"tensor {i}: unknown dtype {_shown(name, 60)}; expected one of {', '.join(DTYPE_BY_NAME)}"
            )
        if (
            type(shape) is not list
            or len(shape) > _MAX_NDIM
            or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)
        ):
            raise PayloadError(
                f"tensor {i}: bad shape {_shown(shape, 100)}; expected a list of at most {_MAX_NDIM} "
                f"ints in [0, 2**63)"
            )
        if type(offset) is not int or type(nbytes) is not int:
            raise PayloadError(
                f"tensor {i}: offset {_shown(offset, 40)} and nbytes {_shown(nbytes, 40)} must be ints"
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
        slots.append(_Slot(offset, nbytes, dtype, shape, strides, where))
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


def _refuse_overlaps(slots: list[_Slot]) -> None:
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


def _build_tensors(
    mv: memoryview,
    table: tuple[_Slot, ...],
    total_len: int,
    device: str | torch.device | None,
    data: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The tensors of a checked table: views of ``mv`` (or of ``data``), or copies on ``device``."""
    if mv.readonly:  # torch warns about read-only buffers; decode's docstring says it instead
        with warnings.catch_warnings():  # (global state: entered only when needed)
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return _views(mv, table, total_len, device, data)
    return _views(mv, table, total_len, device, data)


def _views(
    mv: memoryview,
    table: tuple[_Slot, ...],
    total_len: int,
    device: str | torch.device | None,
    data: torch.Tensor | None,
) -> list[torch.Tensor]:
    source = type(device) is str and device == SOURCE_DEVICE
    dev = torch.device(device) if device is not None and not source else None
    if dev is not None and dev.type == "cpu":
        dev = None
    out: list[torch.Tensor] = []
    # Few tensors: one ``frombuffer`` each. More: one view of the whole buffer per dtype and
    # a strided view of it per tensor, which costs less per tensor (offsets are multiples
    # of ALIGN, so of every item size).
    few = data is None and len(table) <= _FEW_TENSORS
    base = (
        torch.frombuffer(mv, dtype=torch.uint8, count=total_len)
        if data is None and total_len and not few
        else None
    )
    typed: dict[torch.dtype, torch.Tensor] = {}
    for i, (offset, nbytes, dtype, shape, strides, where) in enumerate(table):
        to = dev
        if source:  # where its sender had it: a CPU tensor stays a view (unless it came in device memory)
            to = None if where == "cpu" and data is None else _torch_device(where)
        try:
            if where == "meta":  # no bytes: a meta tensor wherever the others go
                t = torch.empty(shape, dtype=dtype, device="meta")
            elif not nbytes:
                t = torch.empty(
                    shape, dtype=dtype, device=to if to is not None or data is None else data.device
                )
            elif data is not None:
                t = _view_bytes(data[offset : offset + nbytes], dtype).view(shape)
                if to is not None:
                    t = _to_device(t, to)
            else:
                size = dtype.itemsize
                if few:
                    t = torch.frombuffer(mv, dtype=dtype, count=nbytes // size, offset=offset)
                    if len(shape) != 1:
                        t = t.view(shape)
                else:
                    assert base is not None
                    whole = typed.get(dtype)
                    if whole is None:
                        whole = typed[dtype] = _view_bytes(base[: total_len // size * size], dtype)
                    t = whole.as_strided(shape, strides, offset // size)
                if to is not None:
                    t = _to_device(t, to)
        except (RuntimeError, ValueError, OverflowError) as e:
            raise PayloadError(f"tensor {i}: cannot build {dtype} of shape {shape}: {e}") from None
        out.append(t)
    return out


_NO_STRIDES: list[
    int
] = []  # an empty tensor's slot: made with torch.empty, no strides needed (never changed)
_torch_device = functools.lru_cache(maxsize=64)(torch.device)  # a device name, parsed once


def _strides(shape: list[int]) -> list[int]:
    """Row-major strides (in elements) of a contiguous tensor of ``shape``."""
    strides, step = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = step
        step *= max(shape[d], 1)
    return strides


def _view_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (flat uint8) reinterpreted as ``dtype``, through a same-size carrier if needed."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return raw.view(_CARRIERS.get(dtype.itemsize, dtype)).view(dtype)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    carrier = _CARRIERS.get(t.element_size(), t.dtype)
    if carrier == t.dtype:
        return t.to(device)
    return t.view(carrier).to(device).view(t.dtype)


def _forbidden(value: Any) -> PayloadError:
    if type(value) is _Marker:
        return PayloadError(f"misplaced {value.kind} marker: expected it only as the first item of an array")
    return PayloadError("unknown ext type -1 (msgpack timestamp): expected codes 1-4")


def _check_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    for key, value in pairs:
        tk = type(key)
        if tk is not str and tk is not int:
            raise PayloadError(
                f"dict key {_shown(key, 60)} of type {_type_name(tk)}: expected str or int keys"
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


def _decode_tree(v_bytes: memoryview, tensors: list[torch.Tensor]) -> object:
    """Decode the ``"v"`` span in one msgpack pass (no nested unpacking, so no deep C recursion)."""
    n_tensors = len(tensors)

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            index = msgpack.unpackb(data) if data else None
            if type(index) is not int or not 0 <= index < n_tensors:
                raise PayloadError(
                    f"tensor reference {_shown(index, 40)} out of range: the payload has {n_tensors} tensors"
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
        raise _malformed(e) from None
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
                raise PayloadError(f"numpy scalar of dtype {_shown(value[1], 20)} with {len(value[2])} bytes")
            return np.frombuffer(value[2], dtype=dtype)[0]
        if kind == "ndarray" and len(value) == 2 and isinstance(value[1], torch.Tensor):
            _numpy()
            return value[1].numpy()
    except PayloadError:
        raise
    except (ValueError, TypeError) as e:
        raise PayloadError(f"typed value {_shown(kind, 20)} cannot be rebuilt: {e}") from None
    raise PayloadError(f"typed-value marker followed by {_shown(value, 100)}: unknown kind or layout")


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
            f"dataclass marker followed by {_shown(value, 100)}, expected module, qualname, {{field: value}}"
        )
    module, qualname, stored = value
    cls = _find_class(module, qualname, "dataclass")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise PayloadError(
            f"{module}.{qualname} is a {_type_name(type(cls))}, expected a dataclass type; refusing to build it"
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


def tensor_buffer(t: torch.Tensor) -> Any:
    """A bytes-like view of a contiguous CPU tensor's memory that keeps the tensor alive.

    For decoding a payload that arrived in a tensor (a collective's receive buffer, a part of
    a bundle): views made from the returned buffer hold it, and it holds ``t``.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ArgumentError("tensor_buffer needs a contiguous CPU tensor")
    buf = (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    buf._owner = t  # type: ignore[attr-defined]
    return buf
