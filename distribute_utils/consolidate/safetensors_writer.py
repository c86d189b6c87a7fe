"""Internal. The safetensors writer: each file's header written up front, each tensor (or part of one) ``pwrite``-n
at its offset, nothing kept in memory."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ArgumentError, CheckpointFormatError
from ..wire import pwrite_all
from .specs import TensorSpec, safetensors_dtype, tensor_bytes
from .writer_base import CheckpointWriter

__all__ = ["SafetensorsWriter"]

# Bytes written to a file between two starts of its writeback (see SafetensorsWriter._done).
_WRITEBACK_BYTES = 64 << 20


def _safetensors_header(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None
) -> tuple[bytes, dict[str, int]]:
    """Header bytes (length prefix + space-padded JSON) and the data offset of each tensor.

    Tensors are laid out by decreasing item size (stable), so every tensor starts at a multiple of its item
    size: the header is padded to 8 bytes and the data buffer has no holes, as the format requires.
    """
    offsets: dict[str, int] = {}
    pos = 0
    for s in sorted(specs, key=lambda s: -s.dtype.itemsize):
        offsets[s.name] = pos
        pos += s.nbytes
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for s in specs:  # keys in spec order, data in alignment order
        header[s.name] = {
            "dtype": safetensors_dtype(s.dtype, s.name),
            "shape": list(s.shape),
            "data_offsets": [offsets[s.name], offsets[s.name] + s.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


class SafetensorsWriter(CheckpointWriter):
    """Streams tensors into one ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` shards.

    Each file's header is written when the writer is created; each tensor is then ``os.pwrite``-n at its
    offset straight from the tensor's memory. When sharded (``max_shard_size`` given and exceeded), a
    Hugging Face ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {...}}``)
    is written too; shard limits count tensor bytes only, in spec order, and a tensor larger than the limit
    gets a shard of its own. If everything fits in one shard, the single file has no index (as in HF).
    """

    suffix = ".safetensors"
    default_stem = "model"

    def __init__(
        self,
        path_or_dir: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        max_shard_size: int | str | None = None,
        metadata: Mapping[str, str] | None = None,
        side_files: Mapping[str, bytes] | None = None,
    ) -> None:
        """Plans the files and writes their headers.

        Args:
            path_or_dir: an output directory (created if needed; files named ``model...``), or a path
                ending in ``.safetensors`` whose name replaces ``model``.
            specs: every tensor, in output order.
            max_shard_size: bytes per shard (int or ``"5GB"``); ``None``: a single file.
            metadata: ``__metadata__`` string map; default ``{"format": "pt"}`` (what transformers expects).
            side_files: small files beside the tensors' (name -> bytes: a ``config.json``), written and
                published with them by :meth:`close`.
        """
        for s in specs:
            safetensors_dtype(s.dtype, s.name)
        meta = {"format": "pt"} if metadata is None else dict(metadata)
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ArgumentError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        super().__init__(path_or_dir, specs, max_shard_size, side_files)
        self.metadata = meta
        self._fds: list[int] = []
        self._where: dict[str, tuple[int, int]] = {}
        self._parts: dict[str, int] = {}  # bytes written so far of tensors written in parts
        self._dirty = [0] * len(self.shards)  # bytes written per file since writeback was last started
        try:
            for i, shard in enumerate(self.shards):
                head, offsets = _safetensors_header(shard, meta)
                fd = self._held.create(self._temps[i])
                self._fds.append(fd)
                pwrite_all(fd, [memoryview(head)], 0)
                os.ftruncate(fd, len(head) + sum(s.nbytes for s in shard))
                for name, off in offsets.items():
                    self._where[name] = (i, len(head) + off)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Writes one tensor at its offset (see :meth:`CheckpointWriter.write`)."""
        spec = self._check(name, tensor)
        i, offset = self._where[name]
        if spec.nbytes:
            pwrite_all(self._fds[i], [tensor_bytes(tensor)], offset)
        self._done(name)

    def _done(self, name: str) -> None:
        """Marks a tensor written; every ``_WRITEBACK_BYTES`` of a file, starts writing its dirty pages to
        disk (``POSIX_FADV_DONTNEED`` starts writeback without waiting), so that the final fsync does not
        wait for the whole file while reading sat idle."""
        self._written.add(name)
        i, _ = self._where[name]
        self._dirty[i] += self._by_name[name].nbytes
        if self._dirty[i] >= _WRITEBACK_BYTES and hasattr(os, "posix_fadvise"):
            self._dirty[i] = 0
            os.posix_fadvise(self._fds[i], 0, 0, os.POSIX_FADV_DONTNEED)

    def write_part(
        self, name: str, dtype: torch.dtype, shape: Sequence[int], runs: Sequence[tuple[int, memoryview]]
    ) -> None:
        """Writes part of one tensor: ``(byte offset within the tensor, bytes)`` runs, in any order.

        For a reader that holds only a piece of a tensor at a time (a DCP chunk). The tensor counts as
        written when its parts add up to its size; a run outside the tensor is an error.
        """
        spec = self._check_meta(name, dtype, shape)
        i, base = self._where[name]
        filled = self._parts.get(name, 0)
        group: list[memoryview] = []
        start = end = 0
        for offset, data in sorted(runs, key=lambda run: run[0]):
            if offset < 0 or offset + len(data) > spec.nbytes:
                raise CheckpointFormatError(
                    f"tensor '{name}': bytes {offset}..{offset + len(data)} lie outside its {spec.nbytes}"
                )
            if group and offset != end:  # runs next to each other in the file go in one pwritev
                pwrite_all(self._fds[i], group, base + start)
                group = []
            if not group:
                start = end = offset
            group.append(data)
            end += len(data)
            filled += len(data)
        if group:
            pwrite_all(self._fds[i], group, base + start)
        if filled > spec.nbytes:
            raise CheckpointFormatError(f"tensor '{name}': {filled} bytes written, it has {spec.nbytes}")
        self._parts[name] = filled
        if filled == spec.nbytes:
            del self._parts[name]
            self._done(name)

    def _finish_files(self) -> None:
        for fd in self._fds:
            os.fsync(fd)

    def _release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
