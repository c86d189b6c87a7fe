"""Streaming checkpoint writers, and reading safetensors files through ``safetensors.safe_open``.

A writer is created from the full, ordered list of :class:`TensorSpec` (known from metadata before any
data arrives), so every file name and byte offset is fixed up front. Tensors are then written one at a
time, in any order; the writer never holds the whole model:

* :class:`SafetensorsWriter` writes each tensor straight to its offset with ``os.pwrite`` and keeps
  nothing in memory;
* :class:`TorchSaveWriter` (``torch.save`` format) has to pickle a file in one go, so it keeps the tensors
  of each *incomplete* output file and flushes a file as soon as its last tensor arrives.

Files are written under hidden temporary names in the output directory, fsynced, and renamed to their
final names by :meth:`close` (index last). If anything fails, or :meth:`close` finds tensors that were
never written, the temporaries are removed and nothing half-written is visible.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ..errors import ArgumentError, CheckpointFormatError, MisuseError, OutputError, one_line
from ..temporaries import Temporaries
from ..wire import pwrite_all, tensor_buffer

__all__ = [
    "DTYPE_TO_SAFETENSORS",
    "SAFETENSORS_TO_DTYPE",
    "CheckpointFormatError",
    "CheckpointWriter",
    "SafetensorsWriter",
    "TensorSpec",
    "TorchSaveWriter",
    "describe_unreadable",
    "load_safetensors",
    "open_writer",
    "output_paths",
    "parse_size",
    "read_safetensors_metadata",
    "read_safetensors_specs",
    "safetensors_dtype",
    "standalone",
    "tensor_bytes",
    "unreadable_file",
]

logger = logging.getLogger(__name__)


def _build_dtype_map() -> dict[torch.dtype, str]:
    pairs: list[tuple[str, str]] = [
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("float8_e8m0fnu", "F8_E8M0"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint64", "U64"),
        ("uint32", "U32"),
        ("uint16", "U16"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("complex64", "C64"),
    ]
    return {getattr(torch, t): s for t, s in pairs if isinstance(getattr(torch, t, None), torch.dtype)}


#: torch dtype -> safetensors dtype string.
DTYPE_TO_SAFETENSORS: dict[torch.dtype, str] = _build_dtype_map()
#: safetensors dtype string -> torch dtype.
SAFETENSORS_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_SAFETENSORS.items()}


def safetensors_dtype(dtype: torch.dtype, name: str | None = None) -> str:
    """Returns the safetensors dtype string for a torch dtype.

    Raises:
        CheckpointFormatError: unsupported dtype; the message lists the supported ones.
    """
    try:
        return DTYPE_TO_SAFETENSORS[dtype]
    except KeyError:
        what = f"tensor '{name}' has dtype {dtype}" if name else f"dtype {dtype}"
        valid = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_TO_SAFETENSORS)
        raise CheckpointFormatError(f"{what}, which safetensors cannot store; supported: {valid}") from None


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: everything needed to plan a file before data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise CheckpointFormatError(
                f"tensor '{self.name}': negative dimension in shape {shape}; dimensions are ints >= 0"
            )
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of an existing tensor."""
        return cls(name, tensor.dtype, tuple(tensor.shape))


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str) -> int:
    """Parses a byte size: ``1000000``, ``"500MB"`` (10**6), ``"500MiB"`` (2**20), ``"1.5GB"``.

    Units (case-insensitive): B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024).

    Raises:
        ValueError: malformed, unknown unit, or not positive.
    """
    if isinstance(size, bool):
        raise ArgumentError(f"bad size {size!r}: expected an int or a string like '5GB', not a bool")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", size)
        if m is None:
            raise ArgumentError(
                f"bad size {size!r}: write a number with an optional unit, e.g. 5GB or 500MiB"
            )
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise ArgumentError(
                f"bad size {size!r}: unknown unit {m.group(2)!r}; valid units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        value = int(float(m.group(1)) * _UNITS[unit]) if "." in m.group(1) else int(m.group(1)) * _UNITS[unit]
    else:
        raise ArgumentError(f"bad size {size!r}: expected an int or a string like '5GB'")
    if value <= 0:
        raise ArgumentError(f"bad size {size!r}: must be positive")
    return value


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only view of a CPU tensor's bytes (copies only when not contiguous or not on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor_buffer(t.reshape(-1).view(torch.uint8))).cast("B")  # keeps a copy alive


# Bytes written to a file between two starts of its writeback (see SafetensorsWriter._done).
_WRITEBACK_BYTES = 64 << 20


def _plan_shards(specs: Sequence[TensorSpec], max_shard_size: int | None) -> list[list[TensorSpec]]:
    """Greedy split in spec order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_size is None:
        return [list(specs)]
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _split_target(path_or_dir: str | os.PathLike[str], suffix: str, default_stem: str) -> tuple[Path, str]:
    """``dir/`` -> ``(dir, default_stem)``; ``dir/name<suffix>`` -> ``(dir, name)``."""
    p = Path(path_or_dir)
    if p.name.endswith(suffix) and not p.is_dir():
        return p.parent, p.name[: -len(suffix)]
    return p, default_stem


class CheckpointWriter:
    """Base of the streaming writers: spec validation, sharding plan, temp files, close/abort.

    Use as a context manager: leaving the block normally calls :meth:`close`, an exception calls
    :meth:`abort`. Not thread-safe.
    """

    suffix: str = ""
    default_stem: str = ""

    def __init__(
        self,
        path_or_dir: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        max_shard_size: int | str | None = None,
    ) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self._by_name: dict[str, TensorSpec] = {}
        for s in self.specs:
            if s.name in self._by_name:
                raise CheckpointFormatError(
                    f"tensor '{s.name}' appears twice in the specs; give each name once"
                )
            self._by_name[s.name] = s
        self.max_shard_size = None if max_shard_size is None else parse_size(max_shard_size)
        self.directory, self.stem = _split_target(path_or_dir, self.suffix, self.default_stem)
        self.shards = _plan_shards(self.specs, self.max_shard_size)
        self.filenames, self.index_name = self.names(self.stem, len(self.shards))
        self._shard_of: dict[str, int] = {s.name: i for i, shard in enumerate(self.shards) for s in shard}
        self._written: set[str] = set()
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        # Every output file (index last) under a temporary name until close() renames them into place.
        self._held = Temporaries(self.paths)
        self._temps: list[Path] = self._held.temps[: len(self.filenames)]

    @classmethod
    def names(cls, stem: str, n: int) -> tuple[list[str], str | None]:
        """The file names of ``n`` shards (``stem.ext``, or ``stem-0000k-of-0000N.ext``) and of the index
        (``stem.ext.index.json`` when ``n > 1``, else ``None``)."""
        if n == 1:
            return [f"{stem}{cls.suffix}"], None
        files = [f"{stem}-{i:05d}-of-{n:05d}{cls.suffix}" for i in range(1, n + 1)]
        return files, f"{stem}{cls.suffix}.index.json"

    @classmethod
    def scheme(cls, stem: str) -> str:
        """A regular expression matching every name :meth:`names` gives for ``stem``, whatever the split."""
        s, x = re.escape(stem), re.escape(cls.suffix)
        return rf"{s}(-\d{{5}}-of-\d{{5}})?{x}|{s}{x}\.index\.json"

    @property
    def paths(self) -> list[Path]:
        """Final paths of the output files (index last, when sharded); they exist after :meth:`close`."""
        out = [self.directory / f for f in self.filenames]
        if self.index_name:
            out.append(self.directory / self.index_name)
        return out

    @property
    def total_size(self) -> int:
        """Sum of the tensors' byte sizes."""
        return sum(s.nbytes for s in self.specs)

    @property
    def missing(self) -> list[str]:
        """Names not written yet, in spec order."""
        return [s.name for s in self.specs if s.name not in self._written]

    def _check_meta(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> TensorSpec:
        if self._closed:
            raise MisuseError(
                f"cannot write tensor '{name}': the writer is closed (write every tensor before close())"
            )
        spec = self._by_name.get(name)
        if spec is None:
            raise CheckpointFormatError(f"tensor '{name}' is not in this writer's specs")
        if name in self._written:
            raise CheckpointFormatError(f"tensor '{name}' was already written")
        if dtype != spec.dtype or tuple(shape) != spec.shape:
            raise CheckpointFormatError(
                f"tensor '{name}' does not match its spec: got {dtype} {tuple(shape)}, "
                f"expected {spec.dtype} {spec.shape}"
            )
        return spec

    def _check(self, name: str, tensor: torch.Tensor) -> TensorSpec:
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointFormatError(
                f"tensor '{name}': expected a torch.Tensor, got {type(tensor).__name__}"
            )
        return self._check_meta(name, tensor.dtype, tuple(tensor.shape))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Writes one tensor; each spec'd tensor exactly once, in any order.

        Raises:
            CheckpointFormatError: unknown name, written twice, or dtype/shape not matching the spec.
        """
        raise NotImplementedError

    def _finish_files(self) -> None:
        """Makes every temp file complete and durable (fsync); subclass hook."""
        raise NotImplementedError

    def _release(self) -> None:
        """Closes open descriptors and drops buffered tensors; subclass hook."""

    def close(self) -> list[Path]:
        """Checks that every tensor was written, then publishes the files (index last).

        Returns:
            The final paths.

        Raises:
            CheckpointFormatError: tensors were never written (named); nothing is left visible.
        """
        if self._closed:
            return self.paths
        missing = self.missing
        if missing:
            self.abort()
            shown = ", ".join(f"'{m}'" for m in missing[:20])
            more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            raise CheckpointFormatError(
                f"{len(missing)} of {len(self.specs)} tensors were never written: {shown}{more}; "
                f"no output was written to {self.directory}"
            )
        try:
            self._finish_files()
            self._release()
            if self.index_name:
                self._write_index()
            self._held.publish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        logger.info(
            "wrote %d tensors (%d bytes) to %d file(s) in %s",
            len(self.specs),
            self.total_size,
            len(self.filenames),
            self.directory,
        )
        return self.paths

    def abort(self) -> None:
        """Drops everything: closes files and removes the temporaries. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._release()
        self._held.remove()

    def _write_index(self) -> None:
        """Writes the Hugging Face index json under its temporary name (published with the files)."""
        assert self.index_name is not None
        weight_map = {s.name: self.filenames[self._shard_of[s.name]] for s in self.specs}
        index = {
            "metadata": {"total_size": self.total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with os.fdopen(self._held.create(self._held.temps[-1]), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.abort()


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
    ) -> None:
        """Plans the files and writes their headers.

        Args:
            path_or_dir: an output directory (created if needed; files named ``model...``), or a path
                ending in ``.safetensors`` whose name replaces ``model``.
            specs: every tensor, in output order.
            max_shard_size: bytes per shard (int or ``"5GB"``); ``None``: a single file.
            metadata: ``__metadata__`` string map; default ``{"format": "pt"}`` (what transformers expects).
        """
        for s in specs:
            safetensors_dtype(s.dtype, s.name)
        meta = {"format": "pt"} if metadata is None else dict(metadata)
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ArgumentError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        super().__init__(path_or_dir, specs, max_shard_size)
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


def standalone(t: torch.Tensor) -> torch.Tensor:
    """A tensor owning exactly its bytes, so ``torch.save`` does not write a larger base storage."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class TorchSaveWriter(CheckpointWriter):
    """Writes ``torch.save`` files: ``pytorch_model.bin`` or ``pytorch_model-0000k-of-0000N.bin`` + index.

    ``torch.save`` pickles a whole file at once, so this writer keeps the tensors of each output file in
    memory until that file's last tensor arrives, then saves it (to a temp name) and drops them. With a
    single file that means the whole model until the end; use ``max_shard_size`` (or safetensors) to bound
    memory. Views are copied so that only their own bytes are saved.
    """

    suffix = ".bin"
    default_stem = "pytorch_model"

    def __init__(
        self,
        path_or_dir: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        max_shard_size: int | str | None = None,
    ) -> None:
        """Plans the files.

        Args:
            path_or_dir: an output directory (files named ``pytorch_model...``) or a path ending in ``.bin``.
            specs: every tensor, in output order.
            max_shard_size: bytes per shard (int or ``"5GB"``); ``None``: a single file.
        """
        super().__init__(path_or_dir, specs, max_shard_size)
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in self.shards]
        self._saved = [False] * len(self.shards)

    def _save(self, i: int) -> None:
        order = [s.name for s in self.shards[i]]
        state = {n: self._pending[i][n] for n in order}
        with os.fdopen(self._held.create(self._temps[i]), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        self._pending[i] = {}
        self._saved[i] = True
        logger.debug("saved %s (%d tensors)", self.filenames[i], len(order))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Buffers one tensor; saves its file once complete (see :meth:`CheckpointWriter.write`)."""
        self._check(name, tensor)
        i = self._shard_of[name]
        self._pending[i][name] = standalone(tensor)
        self._written.add(name)
        if len(self._pending[i]) == len(self.shards[i]):
            self._save(i)

    def _finish_files(self) -> None:
        for i, saved in enumerate(self._saved):
            if not saved:  # only an empty spec list gets here
                self._save(i)

    def _release(self) -> None:
        self._pending = [{} for _ in self.shards]


def open_writer(
    format: str,
    out: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> CheckpointWriter:
    """Creates a writer by format name.

    Args:
        format: ``"safetensors"`` or ``"torch"``.
        out: output directory (or file path, see the writer classes).
        specs: every tensor, in output order.
        max_shard_size: bytes per shard (int or ``"5GB"``), or ``None`` for one file.
        metadata: safetensors ``__metadata__`` (ignored by the torch writer).

    Raises:
        ValueError: unknown format (valid ones listed).
    """
    if format == "safetensors":
        return SafetensorsWriter(out, specs, max_shard_size, metadata=metadata)
    return _writer_class(format)(out, specs, max_shard_size)


def _writer_class(format: str) -> type[CheckpointWriter]:
    writers: dict[str, type[CheckpointWriter]] = {"safetensors": SafetensorsWriter, "torch": TorchSaveWriter}
    if format not in writers:
        raise ArgumentError(f"unknown checkpoint format {format!r}; valid: {', '.join(writers)}")
    return writers[format]


def output_paths(
    format: str,
    out: str | os.PathLike[str],
    specs: Sequence[TensorSpec] | None = None,
    max_shard_size: int | str | None = None,
) -> tuple[list[Path], str]:
    """The files :func:`open_writer` would write for these arguments, without creating anything, and a
    regular expression matching the names of that naming scheme under any split (what loaders would mix
    with them: for a directory written in torch format also ``model*.safetensors``, which Hugging Face
    loaders prefer).

    ``specs`` are needed only with ``max_shard_size`` (they decide the split).

    Raises:
        ValueError: unknown format; ``out`` ends in the other format's extension; ``max_shard_size``
            without ``specs``.
    """
    cls = _writer_class(format)
    suffix = Path(out).suffix
    if suffix in (".safetensors", ".bin") and suffix != cls.suffix and not Path(out).is_dir():
        raise OutputError(
            f"output '{out}' ends in {suffix}, but the {format} format writes {cls.suffix} files; give a "
            f"file name ending in {cls.suffix}, or a directory"
        )
    directory, stem = _split_target(out, cls.suffix, cls.default_stem)
    if max_shard_size is None:
        n = 1
    elif specs is None:
        raise ArgumentError(
            "output_paths: max_shard_size needs the specs (they decide the split); pass specs too"
        )
    else:
        n = len(_plan_shards(specs, parse_size(max_shard_size)))
    files, index = cls.names(stem, n)
    scheme = cls.scheme(stem)
    if cls is not SafetensorsWriter and stem == cls.default_stem:
        scheme += "|" + SafetensorsWriter.scheme(SafetensorsWriter.default_stem)
    return [directory / f for f in files + ([index] if index else [])], scheme


# --------------------------------------------------------------------------------------------------------
# Reading safetensors.


_ZIP_START = b"PK\x03\x04"  # torch.save (1.6+) writes a zip archive
_ZIP_END = b"PK\x05\x06"  # its end-of-central-directory record, within the last 64 KiB + 22 bytes
_ZIP_TAIL = 65536 + 22
_SAFETENSORS_HEADER_MAX = 100 << 20  # what safetensors itself accepts


def _cause(exc: BaseException | str) -> str:
    """The informative part of a reader's message (torch's advice about ``weights_only`` left out)."""
    text = exc if isinstance(exc, str) else str(exc) or type(exc).__name__
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n", 1)[0]
    elif isinstance(exc, BaseException) and not isinstance(exc, (OSError, RuntimeError, ValueError)):
        text = f"{type(exc).__name__}: {text}"  # KeyError: 101, EOFError from a pickle reader
    text = one_line(text).split(". ", 1)[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _safetensors_end(head: bytes) -> int:
    """The file size a safetensors header describes (8 + header + data), or 0 when it cannot tell."""
    (n,) = struct.unpack("<Q", head[:8])
    if n > _SAFETENSORS_HEADER_MAX:
        return 0
    if len(head) < 8 + n:
        return 8 + n  # the header itself is cut
    try:
        header = json.loads(head[8 : 8 + n])
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return 0
    return 8 + n + max(ends, default=0) if all(isinstance(e, int) for e in ends) else 0


def describe_unreadable(
    path: str | os.PathLike[str], cause: BaseException | str, what: str = "torch.save file"
) -> str:
    """What is wrong with a checkpoint file a reader failed on, judged from its bytes: ``"is empty (0
    bytes)"``, ``"is truncated (...)"``, ``"is not a torch.save file (it begins with ...)"``, ...

    ``cause`` is the reader's exception (a short form of it is quoted where the bytes do not explain it);
    ``what`` names the format expected. Never advises loading with ``weights_only=False``.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(16)
            f.seek(max(0, size - _ZIP_TAIL))
            tail = f.read()
            if what == "safetensors file" and size >= 8:  # the header, to compare the size it describes
                f.seek(0)
                head = f.read(8 + min(struct.unpack("<Q", head[:8])[0], _SAFETENSORS_HEADER_MAX))
    except OSError as exc:
        return f"cannot be read: {one_line(exc)}"
    if size == 0:
        problem = "is empty (0 bytes)"
    elif head.startswith(_ZIP_START) and _ZIP_END not in tail:
        problem = f"is truncated ({size} bytes: a zip archive without its end record)"
    elif head.startswith(_ZIP_START):
        problem = f"is corrupt (a zip archive of {size} bytes that cannot be read: {_cause(cause)})"
    elif size < 22 and _ZIP_START.startswith(head):
        problem = f"is truncated ({size} byte{'' if size == 1 else 's'})"
    elif what == "safetensors file" and size < 8:
        problem = f"is not a valid safetensors file: {size} bytes, truncated or corrupt ({_cause(cause)})"
    elif what == "safetensors file" and _safetensors_end(head) > size:
        problem = (
            f"is not a valid safetensors file: truncated ({size} of the {_safetensors_end(head)} bytes its "
            f"header describes; {_cause(cause)})"
        )
    elif what == "safetensors file":
        problem = f"is not a valid safetensors file: corrupt ({_cause(cause)})"
    elif head.startswith(b"\x80"):  # a pickle: torch.save's pre-1.6 format, or DCP's .metadata
        kind = "a pre-1.6 torch.save file" if what == "torch.save file" else f"a {what}"
        problem = f"is truncated or corrupt ({kind} that cannot be read: {_cause(cause)})"
    else:
        problem = f"is not a {what} (it begins with {head!r})"
    return problem


def unreadable_file(
    path: str | os.PathLike[str], cause: BaseException | str, what: str = "torch.save file"
) -> CheckpointFormatError:
    """The error for a checkpoint file a reader failed on: names it and says what is wrong with it (see
    :func:`describe_unreadable`)."""
    return CheckpointFormatError(
        f"checkpoint file '{path}' {describe_unreadable(path, cause, what)}; copy or save it again "
        "(it cannot be consolidated as it is)"
    )


def _open_safetensors(path: str | os.PathLike[str]) -> Any:
    """``safetensors.safe_open`` (torch framework), its errors as :class:`CheckpointFormatError` naming the file."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "no such safetensors file", os.fspath(path))
    try:
        return safe_open(os.fspath(path), framework="pt")
    except SafetensorError as exc:
        raise unreadable_file(path, exc, "safetensors file") from None


def read_safetensors_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """Returns the ``__metadata__`` map of a safetensors file (empty when absent)."""
    with _open_safetensors(path) as f:
        return dict(f.metadata() or {})


def _specs_of(path: str | os.PathLike[str], f: Any) -> list[TensorSpec]:
    """The specs of an open safetensors file in file (offset) order; a dtype torch lacks is an error."""
    specs = []
    for name in f.offset_keys():
        piece = f.get_slice(name)
        dtype = SAFETENSORS_TO_DTYPE.get(piece.get_dtype())
        if dtype is None:
            raise CheckpointFormatError(
                f"'{path}': tensor '{name}' has unsupported dtype {piece.get_dtype()!r}; "
                f"supported: {', '.join(SAFETENSORS_TO_DTYPE)}"
            )
        specs.append(TensorSpec(name, dtype, tuple(piece.get_shape())))
    return specs


def read_safetensors_specs(path: str | os.PathLike[str]) -> list[TensorSpec]:
    """Reads only the header of a safetensors file and returns its tensor specs, in file (offset) order.

    Raises:
        CheckpointFormatError: malformed header, or a dtype torch has no type for (the message says which).
    """
    with _open_safetensors(path) as f:
        return _specs_of(path, f)


def load_safetensors(path: str | os.PathLike[str], mmap: bool = True) -> dict[str, torch.Tensor]:
    """Loads a safetensors file as ``{name: tensor}`` in file order, with ``safetensors.safe_open``.

    With ``mmap=True`` (default) the tensors are backed by a private (copy-on-write) mapping of the file:
    nothing is read until touched, and writing to a tensor never changes the file. With ``mmap=False``
    the file is read into memory once.

    Raises:
        CheckpointFormatError: not a valid safetensors file, or a dtype torch has no type for.
    """
    with _open_safetensors(path) as f:
        names = [s.name for s in _specs_of(path, f)]
        if mmap:
            return {name: f.get_tensor(name) for name in names}
    from safetensors.torch import load

    with open(path, "rb") as raw:
        tensors = load(raw.read())
    return {name: tensors[name] for name in names}
