"""Internal. An encoded payload and how it is written: :class:`EncodedPayload` (exact length, head, tensor chunks)
into a file descriptor (``pwritev``), into a writable buffer (plain copies, or straight from device
memory), as one ``bytes`` or as buffers for a gathering write; :func:`pwrite_all`, the package's one
write loop. :mod:`.encoding` builds payloads; transports write them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ArgumentError, SpaceError, UnsupportedTypeError
from .format import ALIGN, CARRIERS, FLAG_CHECKSUM, MAGIC, PREFIX_SIZE, PREFIX_STRUCT, VERSION, bytes_view

__all__ = [
    "COPY_CHUNK",
    "IOV_MAX",
    "MAX_WRITE",
    "EncodedPayload",
    "as_uint8",
    "contiguous",
    "crc_of",
    "pwrite_all",
    "segments_after",
    "tensor_bytes",
]

_ZEROS = bytes(ALIGN)

MAX_WRITE = 2**30
"""Bytes one ``pwritev`` call of :func:`pwrite_all` writes at most (larger writes are split)."""
COPY_CHUNK = 2**28
"""Bytes :meth:`EncodedPayload.write_into` copies at a time: a copy holds the GIL, 256 MiB (~25 ms) at a
time lets other threads run between the pieces (smaller pieces copy slower)."""
# Buffers one ``pwritev`` call of pwrite_all takes at most (the system's IOV_MAX, 16 to 1024).
try:
    IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
    IOV_MAX = 16


def tensor_bytes(t: torch.Tensor) -> memoryview:
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
        while j < len(segs) and len(batch) < IOV_MAX and size < MAX_WRITE:
            seg = segs[j]
            room = MAX_WRITE - size
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


def crc_of(segments: Iterable[memoryview], value: int = 0) -> int:
    """The CRC-32 of ``segments`` back to back, continuing from ``value`` (the checksum field)."""
    for seg in segments:
        value = zlib.crc32(seg, value)
    return value


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
                *segments_after(len(self.head), self.chunks, self.nbytes),
            )
        return found

    @property
    def device_resident(self) -> bool:
        """Whether every tensor chunk lives on an accelerator (there is at least one chunk)."""
        return bool(self.chunks) and all(t.device.type != "cpu" for _, t in self.chunks)

    def to_cpu(self) -> EncodedPayload:
        """The same payload with every chunk on the CPU (``self`` when they already are)."""
        for _, t in self.chunks:  # (a loop, not all(...): every send within a host asks, most for none)
            if not t.is_cpu:
                break
        else:
            return self
        return EncodedPayload(
            self.nbytes, self.head, tuple((o, contiguous(t, False)) for o, t in self.chunks)
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
        with bytes_view(buf) as mv:  # released on exit, so an mmap can be closed right after
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
        _, _, flags, header_len, total, _ = PREFIX_STRUCT.unpack_from(self.head)
        if flags & FLAG_CHECKSUM:
            return self
        body = self.head[PREFIX_SIZE:]
        crc = crc_of(segments_after(len(self.head), self.chunks, total), zlib.crc32(body))
        head = PREFIX_STRUCT.pack(MAGIC, VERSION, flags | FLAG_CHECKSUM, header_len, total, crc) + body
        return EncodedPayload(self.nbytes, head, self.chunks)


def _copy_in(mv: memoryview, pos: int, data: memoryview) -> None:
    """Copy host bytes ``data`` into ``mv`` at ``pos``, :data:`COPY_CHUNK` at a time."""
    for start in range(0, data.nbytes, COPY_CHUNK):
        piece = data[start : start + COPY_CHUNK]
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
                _copy_in(mv, offset, tensor_bytes(tensor))
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


def segments_after(pos: int, chunks: tuple[tuple[int, torch.Tensor], ...], nbytes: int) -> list[memoryview]:
    """Byte views covering ``[pos, nbytes)``: zero padding and chunk bytes in order."""
    out = []
    for offset, tensor in chunks:
        if not (tensor.is_cpu and tensor.is_contiguous()):
            raise ArgumentError(f"chunk at offset {offset} must be a contiguous CPU tensor")
        if offset < pos:
            raise ArgumentError(f"chunk at offset {offset} overlaps the previous bytes ending at {pos}")
        if offset > pos:
            out.append(_zeros(offset - pos))
        view = tensor_bytes(tensor)
        out.append(view)
        pos = offset + view.nbytes
    if pos > nbytes:
        raise ArgumentError(f"payload content ends at byte {pos}, past its stated length {nbytes}")
    if pos < nbytes:
        out.append(_zeros(nbytes - pos))
    return out


def _zeros(n: int) -> memoryview:
    return memoryview(_ZEROS)[:n] if n <= ALIGN else memoryview(bytes(n))


def contiguous(t: torch.Tensor, keep_device: bool) -> torch.Tensor:
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
    carrier = CARRIERS.get(t.element_size(), dtype)
    c = t.view(carrier) if carrier != dtype else t
    c = c.contiguous()
    if c.device.type != "cpu" and not keep_device:
        c = c.to("cpu")
    return c.view(dtype) if carrier != dtype else c
