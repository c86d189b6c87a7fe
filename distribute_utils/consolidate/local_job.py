"""Internal. The whole consolidation in one process (no process group, or a world of one).

Every stage in turn, each batch read from all of the stage's TP shards and written in this thread (one
stage's shard windows mapped at a time, so memory stays near one batch); a checkpoint that can stream
into the writer (:meth:`~.formats.Checkpoint.stream`, DCP into safetensors) does so batch by batch. Plan,
writer and report are the ones the ranks use (:mod:`.job`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .job import Job, naming_files, write_item
from .merge_plan import MergePlanEntry
from .plan import Options
from .report import ConsolidationReport

__all__ = ["LocalJob"]


class LocalJob(Job):
    """One process's consolidation: built planned with its output open; then :meth:`run` once."""

    def __init__(
        self, input_dir: str | os.PathLike[str], output: str | os.PathLike[str], options: Options
    ) -> None:
        start = time.perf_counter()
        plan = options.plan(input_dir)
        writer = options.open_writer(output, plan)
        super().__init__(start, input_dir, output, options, plan, writer, rank=0, world=1, transport="none")
        self.output_writer = writer  # = self.writer, never None here

    def run(self) -> ConsolidationReport:
        """Reads and writes everything, then publishes the output (nothing is left on an error)."""
        bar = self.progress()
        try:
            self._copy(bar)
        except BaseException:
            self.output_writer.abort()
            raise
        finally:
            bar.close()
        try:
            files = [os.fspath(p) for p in self.output_writer.close()]
        except BaseException:
            self.output_writer.abort()
            raise
        return self.report(files)

    def _streamed(self, batch: tuple[MergePlanEntry, ...], bar: Any) -> tuple[MergePlanEntry, ...]:
        """Streams what of ``batch`` the checkpoint can stream into the writer (DCP into safetensors: chunk
        by chunk, no tensor built; with a conversion, the tensors it only renames); returns the rest."""
        conversion = self.plan.conversion
        pairs = [(e, e if conversion is None else conversion.renamed(e)) for e in batch]
        streams = [named for _, named in pairs if named is not None]
        if not streams or not self.plan.checkpoint.stream(self.output_writer, streams):
            return batch
        bar.update(sum(e.spec.nbytes for e in streams))
        return tuple(e for e, named in pairs if named is None)

    def _copy(self, bar: Any) -> None:
        """Every stage in turn, each batch read from every TP shard of the stage and written."""
        plan, writer = self.plan, self.output_writer
        checkpoint = plan.checkpoint
        for p in range(plan.stages):
            sources = [checkpoint.open_shard(t, p, plan.batch_bytes) for t in range(plan.tp)]
            ranks = checkpoint.stage_ranks(p)
            for whole in plan.batches[p]:
                batch = self._streamed(whole, bar)
                if not batch:
                    continue
                shards = [s.get(batch) for s in sources]
                for i, entry in enumerate(batch):
                    parts = [s[i] for s in shards]
                    with naming_files(checkpoint):
                        write_item(
                            writer, entry, parts if len(parts) > 1 else parts[0], ranks, plan.conversion
                        )
                    bar.update(entry.spec.nbytes)
                del shards
                for s in sources:
                    s.batch_done()
