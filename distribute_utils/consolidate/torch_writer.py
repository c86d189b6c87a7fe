"""Internal. The ``torch.save`` writer: it keeps the tensors of each incomplete output file and saves a file as soon
as its last tensor arrives."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from .specs import TensorSpec
from .writer_base import CheckpointWriter

__all__ = ["TorchSaveWriter", "standalone"]

logger = logging.getLogger(__name__)


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

    @property
    def held(self) -> int:
        """How many written tensors it holds in memory, waiting for the rest of their shard."""
        return sum(len(p) for p in self._pending)

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
