"""Internal. One rank's part of a consolidation with one rank per shard file (see :mod:`.tp_pp` for the rounds).

:func:`start_rank_job` (every rank, collectively) plans, opens rank 0's output and agrees with every rank
on the plan before anything moves; :meth:`RankJob.run` then plays this rank's role round by round: rank 0
writes its own stage and receives every later stage, a later stage's first TP rank merges and sends, the
other TP ranks send their shards. Errors follow :mod:`.failures`: recorded, drained, raised by all at the
end.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from .. import sync
from ..errors import ArgumentError, ConsolidationError, TransportUnavailableError, plural_list
from ..gather import gather_configs
from ..mesh import ProcessGroupMesh
from ..roles.plan import make_plan
from ..transports.router import request
from .failures import Failure, Failures
from .formats import Checkpoint
from .hf_llama import HfConversion
from .job import Item, Job, naming_files, write_item
from .merge_plan import MergePlanEntry
from .merge_rules import Concat
from .plan import JobPlan, Options
from .report import ConsolidationReport
from .writer_base import CheckpointWriter

__all__ = ["RankJob", "start_rank_job"]

logger = logging.getLogger(__name__)

Task = tuple[MergePlanEntry, Item, Sequence[int]]


class BackgroundWriter:
    """Rank 0's writes, in a thread: senders fill round ``r + 1`` while round ``r`` is being written.

    ``submit`` blocks while ``depth`` rounds are already waiting, which bounds what rank 0 holds. A write
    error is kept and raised (once) by the next ``submit`` or by ``finish``; later batches are dropped.
    """

    def __init__(
        self,
        writer: CheckpointWriter,
        bar: Any,
        checkpoint: Checkpoint,
        depth: int = 1,
        conversion: HfConversion | None = None,
    ) -> None:
        self._writer, self._bar, self._checkpoint = writer, bar, checkpoint
        self._conversion = conversion
        self._queue: queue.Queue[list[Task] | None] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._raised = False
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="distribute-utils-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            tasks = self._queue.get()
            if tasks is None:
                return
            if self._error is None and not self._cancelled:
                try:
                    for entry, item, ranks in tasks:
                        with naming_files(self._checkpoint):
                            write_item(self._writer, entry, item, ranks, self._conversion)
                        self._bar.update(entry.spec.nbytes)
                except BaseException as exc:
                    self._error = exc
            del tasks

    def _check(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def submit(self, tasks: list[Task]) -> None:
        """Queues one batch of ``(entry, item, ranks)``; raises an earlier write error instead."""
        self._check()
        if self._error is None:
            self._queue.put(tasks)

    def finish(self) -> None:
        """Waits until everything queued is written; raises a write error."""
        self._queue.put(None)
        self._thread.join()
        self._check()

    def cancel(self) -> None:
        """Drops what is queued and stops the thread (the writer may then be aborted)."""
        self._cancelled = True
        self._queue.put(None)
        self._thread.join()


def merge_for_forward(entry: MergePlanEntry, shards: list[torch.Tensor], ranks: Sequence[int]) -> Item:
    """What a stage's first TP rank sends to rank 0 for one tensor: concat shards as they are, else merged."""
    if len(shards) == 1:
        return shards[0]
    if isinstance(entry.rule, Concat):
        return shards
    return entry.rule.merge(entry.name, shards, ranks)


def describe_transport(domains: list[str], requested: str, has_workspace: bool) -> str:
    """The report's ``transport``: the route of a gather of every rank (``domains``: each rank's
    shared-memory domain, in rank order), in the plan's words (:attr:`~distribute_utils.roles.plan.Plan.description`)."""
    ranks = list(range(len(domains)))
    try:
        plan = make_plan(request(requested), ranks, dict(zip(ranks, domains)), has_workspace)
    except (ArgumentError, TransportUnavailableError):
        return requested  # (the gathers themselves say what is wrong)
    return plan.description


def start_rank_job(
    input_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: Options,
    *,
    workspace_path: str | os.PathLike[str] | None,
    transport: str,
    seconds: float,
) -> RankJob:
    """Every rank, collectively: plans, checks the world against the shards, opens the output on rank 0,
    then compares every rank's plan and errors. Raises (on every rank) if any rank failed or planned
    differently; nothing is left written."""
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = Failures(rank)
    plan: JobPlan | None = None
    writer: CheckpointWriter | None = None
    digest = ""
    with failures.guard():
        plan = options.plan(input_dir)
        plan.checkpoint.check_ranks(world, input_dir)
        digest = plan.digest(options.format, options.max_shard_size, options.batch_bytes)
        if rank == 0:
            writer = options.open_writer(output, plan)
    statuses = sync.companion(None).exchange(
        msgpack.packb([digest, failures.marker()]), seconds, what="starting the consolidation"
    )
    found = [msgpack.unpackb(s) for s in statuses]
    failed = [Failure.from_wire(m) for _, m in found if m is not None]
    if not failed and any(d != found[0][0] for d, _ in found):
        differing = [r for r, (d, _) in enumerate(found) if d != found[0][0]]
        message = (
            f"{plural_list('rank', differing)} planned a different consolidation than rank 0; pass the same "
            "checkpoint and options on every rank"
        )
        failed = [Failure(differing[0], "ValueError", message)]
    if failed:
        if writer is not None:
            writer.abort()
        raise failures.error_for(failed[0])
    assert plan is not None  # planned on every rank, or raised above
    gather_options = {"workspace_path": workspace_path, "transport": transport, "timeout": seconds}
    return RankJob(start, input_dir, output, options, plan, writer, failures, seconds, gather_options)


class RankJob(Job):
    """This rank's part, once every rank agreed on the plan (:func:`start_rank_job`); :meth:`run` once.

    Attributes (beyond :class:`~.job.Job`'s):
        failures: this rank's first failure, if any.
        pp_rank, tp_rank: this rank's stage and TP rank.
        source: this rank's own shard.
        stage_ranks: the ranks of this rank's stage, in TP order.
        mesh: the ``("pp", "tp")`` mesh of the job's ranks.
    """

    def __init__(
        self,
        start: float,
        input_dir: str | os.PathLike[str],
        output: str | os.PathLike[str],
        options: Options,
        plan: JobPlan,
        writer: CheckpointWriter | None,
        failures: Failures,
        seconds: float,
        gather_options: dict[str, Any],
    ) -> None:
        mesh = ProcessGroupMesh(plan.stages, plan.tp, axis_names=("pp", "tp"), timeout=seconds)
        rank = failures.rank
        # Only rank 0 reports how shards travelled: only it reads where every rank runs (never all-to-all).
        used = ""
        if rank == 0:
            used = describe_transport(
                [p.shm_domain for p in sync.companion(None).peers(seconds)],
                gather_options["transport"],
                gather_options["workspace_path"] is not None,
            )
        world = dist.get_world_size()
        super().__init__(
            start, input_dir, output, options, plan, writer, rank=rank, world=world, transport=used
        )
        self.failures, self.seconds, self.gather_options = failures, seconds, gather_options
        self.mesh = mesh
        checkpoint = plan.checkpoint
        self.pp_rank, self.tp_rank = checkpoint.rank_grid.coordinate(rank)
        self.source = checkpoint.open_shard(self.tp_rank, self.pp_rank, plan.batch_bytes)
        self.stage_ranks = checkpoint.stage_ranks(self.pp_rank)
        logger.info(
            "rank %d (pp %d, tp %d): %d tensors, %d bytes, %d rounds over %s",
            rank,
            self.pp_rank,
            self.tp_rank,
            len(plan.entries),
            plan.total_bytes,
            plan.rounds,
            used,
        )

    # -- one round's steps ---------------------------------------------------------------------------
    def _tp_round(self, batch: tuple[MergePlanEntry, ...]) -> list[list[torch.Tensor]] | None:
        """Step 1: gathers the batch's shards to the stage's first TP rank; per entry, shards in TP order.

        Returns ``None`` on the other TP ranks, and when this rank or a peer failed.
        """
        failures = self.failures
        own: list[torch.Tensor] = []
        if not failures.failed:
            with failures.guard():
                own = self.source.get(batch)
        tp = self.plan.tp
        if tp == 1:
            return [[t] for t in own] if not failures.failed else None
        payload = {"e": failures.marker(), "t": own if not failures.failed else []}
        result: list[list[torch.Tensor]] | None = None
        with failures.guard(), gather_configs(payload, self.mesh, "tp", **self.gather_options) as got:
            del payload, own
            if got:
                for part in got[1:]:
                    failures.note(part["e"])
                if not failures.failed:
                    result = [[got[t]["t"][i] for t in range(tp)] for i in range(len(batch))]
        return result

    def _pp_send(self, batch: tuple[MergePlanEntry, ...] | None) -> None:
        """Steps 2-3 on a later stage's first TP rank: merge what needs merging, send the batch to rank 0."""
        failures = self.failures
        items: list[Item] = []
        if batch is not None:
            shards = self._tp_round(batch)
            if shards is not None and not failures.failed:
                with failures.guard(), naming_files(self.plan.checkpoint):
                    items = [merge_for_forward(e, s, self.stage_ranks) for e, s in zip(batch, shards)]
            del shards
        payload = {"e": failures.marker(), "t": items if not failures.failed else []}
        del items
        with failures.guard(), gather_configs(payload, self.mesh, "pp", **self.gather_options):
            pass
        self.source.batch_done()

    def _write_own(self, batch: tuple[MergePlanEntry, ...], bg: BackgroundWriter) -> None:
        """Rank 0: its own stage's batch, handed to the writer thread (merged or placed into the output)."""
        shards = self._tp_round(batch)
        if shards is not None and not self.failures.failed:
            with self.failures.guard():
                bg.submit(
                    [
                        (e, parts if len(parts) > 1 else parts[0], self.stage_ranks)
                        for e, parts in zip(batch, shards)
                    ]
                )
        del shards
        self.source.batch_done()

    def _receive_stages(self, r: int, bg: BackgroundWriter) -> None:
        """Rank 0, step 3: batch ``r`` of every later stage, handed to the writer thread as it arrives."""
        failures, plan = self.failures, self.plan
        with (
            failures.guard(),
            gather_configs({"e": None, "t": []}, self.mesh, "pp", **self.gather_options) as got,
        ):
            tasks: list[Task] = []
            for p in range(1, plan.stages):
                failures.note(got[p]["e"])
                if failures.failed:
                    return
                batch = plan.batches[p][r] if r < len(plan.batches[p]) else ()
                items = got[p]["t"]
                if len(items) != len(batch):
                    raise ConsolidationError(
                        f"stage {p} sent {len(items)} tensors in round {r}, expected {len(batch)}"
                    )
                ranks = plan.checkpoint.stage_ranks(p)
                tasks += [(entry, item, ranks) for entry, item in zip(batch, items)]
            bg.submit(tasks)

    # -- roles -----------------------------------------------------------------------------------------
    def _run_first(self, writer: CheckpointWriter, bar: Any) -> None:
        """Rank 0: round by round, its own stage's batch and every later stage's, to the writer thread."""
        mine = self.plan.batches[0]
        bg = BackgroundWriter(writer, bar, self.plan.checkpoint, conversion=self.plan.conversion)
        try:
            for r in range(self.plan.rounds):
                if r < len(mine):
                    self._write_own(mine[r], bg)
                if self.plan.stages > 1:
                    self._receive_stages(r, bg)
        except BaseException:
            bg.cancel()
            raise
        with self.failures.guard():
            bg.finish()

    def _run_sender(self) -> None:
        """Any other rank: a stage's first TP rank sends every round to rank 0; the others their shards."""
        mine = self.plan.batches[self.pp_rank]
        if self.tp_rank == 0:
            for r in range(self.plan.rounds):
                self._pp_send(mine[r] if r < len(mine) else None)
        else:
            for batch in mine:
                self._tp_round(batch)
                self.source.batch_done()

    def run(self) -> ConsolidationReport:
        """Runs this rank's role to the end, then agrees on the outcome with every rank."""
        bar = self.progress()
        try:
            if self.writer is not None:  # rank 0
                self._run_first(self.writer, bar)
            else:
                self._run_sender()
        except BaseException:
            if self.writer is not None:
                self.writer.abort()
            raise
        finally:
            bar.close()
        return self._finish()

    def _finish(self) -> ConsolidationReport:
        """Every rank: exchanges the failures; rank 0 publishes the output unless one failed, then tells
        every rank the outcome, which each returns (the report) or raises."""
        world = sync.companion(None)
        markers = [
            msgpack.unpackb(s)
            for s in world.exchange(
                msgpack.packb(self.failures.marker()), self.seconds, what="finishing the consolidation"
            )
        ]
        failure = Failure.first_of(markers)
        summary: dict[str, Any] | None = None
        if self.writer is not None:  # rank 0
            if failure is None:
                try:
                    files = [os.fspath(p) for p in self.writer.close()]
                except Exception as exc:
                    self.writer.abort()
                    self.failures.fail(exc)
                    failure = self.failures.first
                else:
                    summary = self.report(files).to_dict()
            else:
                self.writer.abort()
        result = world.exchange(
            msgpack.packb([failure.wire() if failure else None, summary] if self.rank == 0 else None),
            self.seconds,
            what="publishing the consolidation's result",
        )
        final_failure, final_summary = msgpack.unpackb(result[0])
        if final_failure is not None:
            raise self.failures.error_for(Failure.from_wire(final_failure))
        report = ConsolidationReport.from_dict(final_summary)
        report.rank = self.rank
        return report
