"""Internal. The base of the streaming checkpoint writers: spec validation, the split into files, temporaries,
close and abort.

A writer is created from the full, ordered list of :class:`~.specs.TensorSpec` (known from metadata before
any data arrives), so every file name and byte offset is fixed up front. Tensors are then written one at a
time, in any order; the writer never holds the whole model (:class:`~.safetensors_writer.SafetensorsWriter`,
:class:`~.torch_writer.TorchSaveWriter`).

Files are written under hidden temporary names in the output directory, fsynced, and renamed to their
final names by :meth:`CheckpointWriter.close` (index last). If anything fails, or ``close`` finds tensors
that were never written, the temporaries are removed and nothing half-written is visible.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import torch

from ..errors import CheckpointFormatError, MisuseError
from ..temporaries import Temporaries
from .specs import TensorSpec, parse_size

__all__ = ["CheckpointWriter", "plan_shards", "split_target"]

logger = logging.getLogger(__name__)


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int | None) -> list[list[TensorSpec]]:
    """The tensors of each output file for a ``max_shard_size`` (``None``: one file): a greedy split in
    spec order; a tensor larger than the limit gets a shard of its own."""
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


def split_target(path_or_dir: str | os.PathLike[str], suffix: str, default_stem: str) -> tuple[Path, str]:
    """The output directory and file stem a writer gets for ``path_or_dir``: ``dir/`` -> ``(dir,
    default_stem)``; ``dir/name<suffix>`` -> ``(dir, name)``."""
    p = Path(path_or_dir)
    if p.name.endswith(suffix) and not p.is_dir():
        return p.parent, p.name[: -len(suffix)]
    return p, default_stem


class CheckpointWriter(ABC):
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
        side_files: Mapping[str, bytes] | None = None,
    ) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.side_files = dict(side_files or {})  # (small files beside the tensors: a config.json)
        self._by_name: dict[str, TensorSpec] = {}
        for s in self.specs:
            if s.name in self._by_name:
                raise CheckpointFormatError(
                    f"tensor '{s.name}' appears twice in the specs; give each name once"
                )
            self._by_name[s.name] = s
        self.max_shard_size = None if max_shard_size is None else parse_size(max_shard_size)
        self.directory, self.stem = split_target(path_or_dir, self.suffix, self.default_stem)
        self.shards = plan_shards(self.specs, self.max_shard_size)
        self.filenames, self.index_name = self.names(self.stem, len(self.shards))
        self._shard_of: dict[str, int] = {s.name: i for i, shard in enumerate(self.shards) for s in shard}
        self._written: set[str] = set()
        self._closed = False
        self._made: list[Path] = []  # the directories it creates, deepest first: abort removes them if empty
        d = self.directory
        while not d.exists() and d != d.parent:
            self._made.append(d)
            d = d.parent
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
        out = [self.directory / f for f in (*self.filenames, *self.side_files)]
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

    @abstractmethod
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Writes one tensor; each spec'd tensor exactly once, in any order.

        Raises:
            CheckpointFormatError: unknown name, written twice, or dtype/shape not matching the spec.
        """

    @abstractmethod
    def _finish_files(self) -> None:
        """Makes every temp file complete and durable (fsync); subclass hook."""

    @abstractmethod
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
            self._write_side_files()
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
        """Drops everything: closes files, removes the temporaries and the directories it created (while
        empty). Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._release()
        self._held.remove()
        for d in self._made:  # (only what it created, only while empty: never another's file)
            try:
                d.rmdir()
            except OSError:
                break

    def _write_side_files(self) -> None:
        """Writes :attr:`side_files` under their temporary names (published with the tensors' files)."""
        temps = self._held.temps[len(self.filenames) :]
        for temp, data in zip(temps, self.side_files.values(), strict=False):
            with os.fdopen(self._held.create(temp), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

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
