"""Internal. Encoding: a config tree (tensors anywhere in it) into an :class:`~.payload.EncodedPayload`.

:func:`encode` walks the tree (:class:`_Encoder`: the supported types, paths in error messages, the
depth limit and reference cycles), lays the header and tensors out (:func:`_layout`, recent layouts
kept) and sets the checksum; :func:`nesting_error` is the walker's error for code that walks a tree
without encoding it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import zlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgpack
import torch

from ..caches import Recent
from ..errors import ArgumentError, UnsupportedTypeError
from .format import (
    DEFAULT_MAX_HEADER_BYTES,
    DTYPE_BY_NAME,
    EXT_BIGINT,
    EXT_DATACLASS,
    EXT_TENSOR,
    EXT_TUPLE,
    EXT_TYPED,
    FLAG_CHECKSUM,
    LONE_TREE,
    MAGIC,
    MAX_DEPTH,
    PREFIX_SIZE,
    PREFIX_STRUCT,
    RECENT_BYTES_MAX,
    RECENT_MAX,
    VERSION,
    align,
    pack,
    type_name,
)
from .payload import EncodedPayload, contiguous, crc_of, segments_after

__all__ = ["encode", "nesting_error"]

_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1

_TUPLE_EXT = msgpack.ExtType(EXT_TUPLE, b"")
_DATACLASS_EXT = msgpack.ExtType(EXT_DATACLASS, b"")
_TYPED_EXT = msgpack.ExtType(EXT_TYPED, b"")

_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}

_PLAIN = frozenset({str, float, bool, bytes, type(None)})
_SUPPORTED_TEXT = (
    "supported: None, bool, int, float, str, bytes, list, tuple, dict with str/int keys, "
    "OrderedDict, enum members, numpy scalars and arrays (bool, int, float, complex), "
    "dataclass instances and torch.Tensor"
)


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
        f"{type_name(type(obj))} is at level {len(path) + 1}, past the limit of {MAX_DEPTH} (wire.MAX_DEPTH) "
        "that every rank applies; flatten the config (e.g. a dict keyed by path) before gathering it"
    )


def _cycle_error(root: str, path: Sequence[Any], obj: object, first: Sequence[Any]) -> UnsupportedTypeError:
    return UnsupportedTypeError(
        f"{_short_path(root, path)}: reference cycle: this {type_name(type(obj))} is the object at "
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


def unsupported_type_error(root: str, path: Sequence[Any], obj: object) -> UnsupportedTypeError:
    """The ``TypeError`` :func:`encode` raises for a value of a type it does not carry (a subclass of a
    built-in among them), at ``path`` (as :func:`nesting_error`'s), for code that walks a config tree
    without encoding it (the first rank's own value)."""
    tp = type(obj)
    return UnsupportedTypeError(
        f"{_path_text(root, path)}: cannot encode a value of type {type_name(tp)}; {_SUPPORTED_TEXT}{_hint(tp)}"
    )


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
                            f"{self.path()}: dict key {key!r:.60} of type {type_name(tk)} is not "
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
        raise unsupported_type_error(self._root, self._path, obj)

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
    """``t`` as it travels (see :func:`contiguous`), once checked to be a kind the format carries
    (``path()`` names it in the error)."""
    tp = type(t)
    if tp is not torch.Tensor and tp is not torch.nn.Parameter:
        raise UnsupportedTypeError(
            f"{path()}: tensor subclass {type_name(tp)} is not supported; pass a plain "
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
    return contiguous(t, keep_device)


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


_TENSOR_REFS = [msgpack.ExtType(EXT_TENSOR, pack(i)) for i in range(256)]


def _tensor_ref(index: int) -> msgpack.ExtType:
    """The tree's reference to tensor ``index`` (the first ones made once)."""
    return _TENSOR_REFS[index] if index < 256 else msgpack.ExtType(EXT_TENSOR, pack(index))


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
        v_bytes, tensors = LONE_TREE, [_plain_tensor(obj, keep_device, lambda: root)]
        devices = [_device_name(obj)]
        shapes: tuple[tuple[torch.dtype, torch.Size, str], ...] = ((obj.dtype, obj.shape, devices[0]),)
    else:
        enc = _Encoder(root, keep_device)
        tree = enc.walk(obj)
        try:
            v_bytes = LONE_TREE if tree is _TENSOR_REFS[0] else pack(tree)
        except UnicodeEncodeError as e:
            raise UnsupportedTypeError(f"{root}: contains a str that is not valid UTF-8 ({e})") from None
        tensors, devices = enc.tensors, enc.devices
        shapes = tuple([(t.dtype, t.shape, d) for t, d in zip(tensors, devices)]) if tensors else ()
    small = len(v_bytes) <= RECENT_BYTES_MAX
    layout = _LAYOUTS.get((v_bytes, shapes)) if small else None
    if layout is None:
        layout = _layout(v_bytes, tensors, devices, root)
        if small:
            _LAYOUTS.put((v_bytes, shapes), layout)
    header_len, offsets, total, body, plain_head = layout
    chunks = (  # (a list made first: one call, where a generator is resumed once per tensor)
        tuple([(o, t) for o, t, d in zip(offsets, tensors, devices, strict=True) if t.nbytes and d != "meta"])
        if tensors
        else ()
    )
    if not checksum:
        return EncodedPayload(total, plain_head, chunks)
    head_end = chunks[0][0] if chunks else total
    crc = crc_of(segments_after(head_end, chunks, total), zlib.crc32(body))
    return EncodedPayload(
        total, PREFIX_STRUCT.pack(MAGIC, VERSION, FLAG_CHECKSUM, header_len, total, crc) + body, chunks
    )


_LAYOUTS: Recent[Any, Any] = Recent(RECENT_MAX)


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
    start = align(PREFIX_SIZE + len(header_base) + 1)
    while True:
        entries: list[list[Any]] = []
        cursor = start
        end = 0
        for t, where in zip(tensors, devices):
            nb = 0 if where == "meta" else t.nbytes
            entries.append([_DTYPE_NAMES[t.dtype], list(t.shape), cursor, nb, where])
            end = cursor + nb
            cursor = align(end)
        header = header_base + pack(entries)
        header_end = PREFIX_SIZE + len(header)
        new_start = align(header_end)
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
        PREFIX_STRUCT.pack(MAGIC, VERSION, 0, len(header), total, 0) + body,
    )
