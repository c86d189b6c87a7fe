"""Internal. What both ways of running a consolidation share: the plan, rank 0's writer, the progress bar, the report.

:class:`~.local_job.LocalJob` runs the whole consolidation in one process; :class:`~.rank_job.RankJob`
is one rank's part of a job of one rank per shard. Each is built ready to run (planned, the output
opened on rank 0) and then :meth:`Job.run` once.
"""

from __future__ import annotations

import abc
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import MergeError
from .hf_llama import HfConversion
from .merge_plan import MergePlanEntry
from .merge_rules import Concat
from .merge_write import write_merged
from .plan import JobPlan, Options
from .report import ConsolidationReport, peak_rss_bytes
from .writer_base import CheckpointWriter

if TYPE_CHECKING:
    from .formats import Checkpoint

__all__ = ["Item", "Job", "naming_files", "progress_bar", "write_item"]

#: One output tensor as it reaches rank 0: merged, or the list of its concat shards.
Item = torch.Tensor | list[torch.Tensor]


def write_item(
    writer: CheckpointWriter,
    entry: MergePlanEntry,
    item: Item,
    ranks: Sequence[int],
    conversion: HfConversion | None = None,
) -> None:
    """Writes one tensor (merged, or concat shards placed by the writer; with a ``conversion``, under its
    new name, or merged and then its pieces, one tensor at a time), naming the output on I/O errors."""
    renamed = conversion.renamed(entry) if conversion is not None else None
    if renamed is not None:
        if not isinstance(item, torch.Tensor) and not isinstance(entry.rule, Concat):
            item = entry.rule.merge(entry.name, item, ranks)  # (a merge error names the Megatron tensor)
        entry, conversion = renamed, None
    try:
        if conversion is not None:
            merged = item if isinstance(item, torch.Tensor) else entry.rule.merge(entry.name, item, ranks)
            for name, piece in conversion.pieces(entry, merged):
                writer.write(name, piece)
        elif isinstance(item, torch.Tensor):
            writer.write(entry.name, item)
        else:
            write_merged(writer, entry.name, entry.rule, item, ranks)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot write tensor '{entry.name}' of the consolidated checkpoint: {exc.strerror or exc}",
            os.fspath(writer.directory),
        ) from exc


@contextlib.contextmanager
def naming_files(checkpoint: Checkpoint) -> Iterator[None]:
    """Merges inside name the files and ranks of the tensor a :class:`MergeError` names (the rules know
    only its name and ranks)."""
    try:
        yield
    except MergeError as exc:
        raise MergeError(f"{exc}{checkpoint.where(str(exc))}") from None


def progress_bar(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar of ``total`` bytes on stderr, drawn only when ``enabled`` and stderr is a terminal."""
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore, which a process ended by an interrupt
    # (os._exit) leaves to the resource tracker to complain about; threads are all it has to guard.
    tqdm.set_lock(threading.RLock())

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not enabled or not sys.stderr.isatty(),  # a bar is for a terminal, not a log
        dynamic_ncols=True,
        leave=False,
    )


class Job(abc.ABC):
    """One consolidation as this process takes part in it; subclasses say how (:meth:`run`).

    Attributes:
        start: ``time.perf_counter()`` at entry (the report's ``seconds`` count from it).
        input_dir: the checkpoint, as given.
        output: the output, as given.
        options: what was asked.
        plan: the plan and its batches (the same on every rank).
        writer: the output's writer on rank 0 (or the one process), ``None`` elsewhere.
        rank: this process's global rank (0 alone).
        world: ranks taking part (1 alone).
        transport: how shards travel, for the report (``"none"`` alone).
    """

    def __init__(
        self,
        start: float,
        input_dir: str | os.PathLike[str],
        output: str | os.PathLike[str],
        options: Options,
        plan: JobPlan,
        writer: CheckpointWriter | None,
        *,
        rank: int,
        world: int,
        transport: str,
    ) -> None:
        self.start = start
        self.input_dir, self.output, self.options = input_dir, output, options
        self.plan, self.writer = plan, writer
        self.rank, self.world, self.transport = rank, world, transport

    @abc.abstractmethod
    def run(self) -> ConsolidationReport:
        """Runs this process's part to the end; returns the report (rank 0's numbers on every rank)."""

    def progress(self) -> Any:
        """The progress bar of this run (drawn on rank 0 only); the caller closes it."""
        return progress_bar(self.plan.total_bytes, self.options.progress and self.rank == 0, "consolidating")

    def report(self, files: list[str]) -> ConsolidationReport:
        """The report of the finished consolidation (rank 0's), ``files`` published."""
        checkpoint = self.plan.checkpoint
        return ConsolidationReport(
            input_dir=os.fspath(self.input_dir),
            output=os.fspath(self.output),
            layout=checkpoint.kind,
            tp=checkpoint.tp,
            pp=checkpoint.pp,
            world_size=self.world,
            format=self.options.format,
            tensors=len(self.plan.entries if self.plan.conversion is None else self.plan.conversion.specs),
            bytes=self.plan.total_bytes,
            seconds=time.perf_counter() - self.start,
            transport=self.transport,
            rounds=self.plan.rounds,
            batch_bytes=self.plan.batch_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            files=files,
            rank=0,
            left_out=[[name, why] for name, why in self.plan.left_out],
            converted=self.plan.conversion.summary() if self.plan.conversion is not None else None,
        )
