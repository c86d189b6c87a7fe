"""Internal. Decoding: a payload back into its config tree, its tensors zero-copy views of the caller's buffer.

:func:`decode` (a bytes-like buffer, or a flat uint8 tensor on any device) and :func:`decode_split`
(the head on the host, the bytes in a tensor) check the head through :mod:`.header` (checked heads
kept), the length, the checksum and the devices, build the tensors (views, or copies on a device) and
the tree through :mod:`.tree`; :func:`unusable_device`, :func:`head_known`, :func:`tensor_buffer`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import warnings
import zlib
from typing import Any

import torch

from ..caches import Recent
from ..errors import ArgumentError, DeviceUnavailableError, PayloadError, UnsupportedTypeError
from .format import (
    CARRIERS,
    DEFAULT_MAX_HEADER_BYTES,
    FLAG_CHECKSUM,
    HEADER_LEN_AT,
    LENGTH_FIELD,
    LONE_TREE,
    PREFIX_SIZE,
    RECENT_BYTES_MAX,
    RECENT_MAX,
    SOURCE_DEVICE,
    VERSION_FIELD,
    bytes_view,
)
from .header import Slot, parse_header, read_prefix, tensor_table
from .tree import decode_tree

__all__ = ["checked_lone_slot", "decode", "decode_split", "head_known", "tensor_buffer", "unusable_device"]

_FEW_TENSORS = 2  # payloads with at most this many tensors view each with its own frombuffer


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
    mv = bytes_view(buf)
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
        v_span, t_span = parse_header(header, header_len)
        (version,) = VERSION_FIELD.unpack_from(mv, 4)
        table = tensor_table(header[t_span[0] : t_span[1]], header_end, total_len, version)
        lone = len(table) == 1 and header[v_span[0] : v_span[1]] == LONE_TREE
        if key is not None and not flags & FLAG_CHECKSUM:  # (a checksum differs every time)
            _HEADS.put(key, (flags, header_len, total_len, checksum, v_span, table, lone))
    source = type(device) is str and device == SOURCE_DEVICE
    if not table:  # a config without tensors: nothing to build (a bad device raises all the same)
        if device is not None and not source:
            torch.device(device)
        return decode_tree(mv[PREFIX_SIZE + v_span[0] : PREFIX_SIZE + v_span[1]], [])
    missing = _missing_device(table) if source else None
    if data is None and missing is None and len(table) > 1:
        whole = _one_device(table, device)
        if whole is not None:  # one host-to-device copy of the payload; its tensors are views of it
            data = _build_tensors(
                mv, (Slot(0, total_len, torch.uint8, [total_len], [1], "cpu"),), total_len, whole
            )[0]
    tensors = _build_tensors(mv, table, total_len, None if missing else device, data)
    tree = tensors[0] if lone else decode_tree(mv[PREFIX_SIZE + v_span[0] : PREFIX_SIZE + v_span[1]], tensors)
    if missing is not None:  # (the tree, with CPU views, only to name the tensor)
        i, why = missing
        raise DeviceUnavailableError(
            f"{_path_to(tree, tensors[i], root)} is on {table[i].device} at its sender, a device this "
            f"process does not have ({why}); torch.load would fail here too: pass device= to put "
            "received tensors on a device this rank has (e.g. device='cpu')"
        )
    return tree


def _one_device(table: tuple[Slot, ...], device: str | torch.device | None) -> torch.device | None:
    """The one accelerator every tensor with bytes goes to when decoded to ``device``, if there is one."""
    if type(device) is str and device == SOURCE_DEVICE:
        found = {slot.device for slot in table if slot.nbytes and slot.device != "meta"}
        return _torch_device(found.pop()) if len(found) == 1 and "cpu" not in found else None
    if device is None:
        return None
    dev = torch.device(device)
    return None if dev.type in ("cpu", "meta") else dev


def _missing_device(table: tuple[Slot, ...]) -> tuple[int, str] | None:
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
    (header_len,) = LENGTH_FIELD.unpack_from(mv, HEADER_LEN_AT)
    if header_len > min(max_header_bytes, RECENT_BYTES_MAX):
        return None
    return mv[: PREFIX_SIZE + header_len].tobytes()


# Checked heads (prefix and header): their bytes -> what they say.
_HEADS: Recent[Any, Any] = Recent(RECENT_MAX)


def checked_lone_slot(buf: Any) -> tuple[int, Slot] | None:
    """The stated length and tensor entry of the payload in ``buf`` when :func:`decode` took its head as
    checked before (every check passed) and its tree is one tensor with bytes, on the CPU at its sender,
    with no checksum; None otherwise (for :class:`.lone.LoneHead`)."""
    mv = bytes_view(buf)
    key = _head_key(mv, DEFAULT_MAX_HEADER_BYTES)
    known = _HEADS.get(key) if key is not None else None
    if known is None:
        return None
    flags, _, total_len, _, _, table, lone = known
    if not lone or flags & FLAG_CHECKSUM or table[0].device != "cpu" or not table[0].nbytes:
        return None
    return total_len, table[0]


def head_known(buf: Any, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> bool:
    """Whether :func:`decode` takes the head (prefix and header) of the payload in ``buf`` as checked
    before, and skips those checks (never the length, device and checksum ones); for tests and
    diagnostics."""
    key = _head_key(bytes_view(buf), max_header_bytes)
    return key is not None and key in _HEADS


def _build_tensors(
    mv: memoryview,
    table: tuple[Slot, ...],
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
    table: tuple[Slot, ...],
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


_torch_device = functools.lru_cache(maxsize=64)(torch.device)  # a device name, parsed once


def _view_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (flat uint8) reinterpreted as ``dtype``, through a same-size carrier if needed."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return raw.view(CARRIERS.get(dtype.itemsize, dtype)).view(dtype)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    carrier = CARRIERS.get(t.element_size(), t.dtype)
    if carrier == t.dtype:
        return t.to(device)
    return t.view(carrier).to(device).view(t.dtype)


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
