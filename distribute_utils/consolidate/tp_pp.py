"""Distributed consolidation of a TP x PP checkpoint into one checkpoint, streamed to rank 0.

The job has ``tp * pp`` ranks laid out as ``ProcessGroupMesh(pp, tp, axis_names=("pp", "tp"))``, so
``rank = pp_rank * tp + tp_rank`` (TP fastest, as Megatron numbers ranks), and rank ``(pp_i, tp_j)`` reads
only the shard ``(tp_j, pp_i)``, memory-mapped.

Planning: every rank opens the layout and plans from metadata alone (:func:`~.layouts.plan_merge`: shard
headers, no tensor data), so every rank knows every output tensor, its rule, its merged spec and the batches
below without any message; a digest of the plan is compared across ranks before anything moves.

Batches: each stage's tensors, in plan order, are cut into batches of at most ``batch_bytes`` merged bytes
(a larger tensor travels alone). Round ``r`` moves batch ``r`` of every stage; a stage with fewer batches
sends an empty one. Call order, on every rank, for ``r in range(rounds)``:

1. **TP** (stages with ``tp > 1``, while the stage has batch ``r``): every rank of the stage's TP group
   enters ``gather_configs({"e": error, "t": [shard, ...]}, mesh, "tp")``; the stage's first TP rank
   receives the shards of the batch from every TP rank (zero-copy views of shared memory).
2. **merge** on the stage's first TP rank: tensors whose rule is ``concat`` are forwarded as their list of
   shards (rank 0 places them straight into the file, no concatenated copy is ever built); any other rule
   (``same``, ``max``, ``sum``, ...) is merged here.
3. **PP** (``pp > 1``; first TP ranks only): every stage's first TP rank enters
   ``gather_configs({"e": error, "t": [item, ...]}, mesh, "pp")``; rank 0 receives batch ``r`` of every
   stage and writes each tensor as it arrives (global names: layers renumbered by stage offset).

Rank 0 hands what it receives to a writer thread (``pwrite``/``pwritev`` straight from the received views),
so senders fill round ``r + 1`` while round ``r`` is being written; a sender is released as soon as rank 0
has mapped its payload, and TP groups of different stages never wait for each other. Rank 0 holds the
batches of at most three rounds (one being written, one queued, one arriving): about ``3 * pp *
batch_bytes`` plus the pages of its own shard (remapped every batch), never the model.

One process (no process group, or a world of one) runs the same job object alone: every stage in turn, each
batch read from all of the stage's TP shards and written in this thread (one stage's shard windows mapped at
a time, so memory stays near one batch); plan, writer and report are the ones the ranks use.

Errors: a failure on any rank (a ``same`` tensor that differs, a full disk, a bad shard) does not leave the
others hanging: the failing rank keeps taking part in the remaining rounds with an error marker instead of
data, the marker travels to rank 0, rank 0 aborts its writer (nothing half-written is left), and a final
exchange makes every rank raise: the originating rank its own exception, the others
:class:`ConsolidationError` naming it. Only a lost peer (:class:`~distribute_utils.errors.PeerLostError`)
is raised at once.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from .. import sync
from ..errors import DistributeError, PeerLostError, one_line, plural_list
from ..gather import gather_configs
from ..mesh import ProcessGroupMesh
from .dcp import DcpCheckpoint
from .formats import Checkpoint, open_checkpoint
from .layouts import CheckpointLayout, MergePlanEntry, plan_merge
from .rules import Concat, MergeError, RuleTable, write_merged
from .writers import CheckpointWriter, SafetensorsWriter, open_writer, parse_size

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "OUTPUT_FORMATS",
    "ConsolidationError",
    "ConsolidationReport",
    "consolidate_checkpoint",
    "consolidate_local",
    "consolidate_on_local_ranks",
    "peak_rss_bytes",
    "plan_checkpoint",
    "resolve_rules",
]

logger = logging.getLogger(__name__)

#: Merged bytes per stage and round (a larger tensor travels alone). 16 MiB keeps the per-round cost
#: (~2 ms) under 10 % while rank 0 holds little; see docs/performance.md.
DEFAULT_BATCH_BYTES = 16 * 2**20
#: Output formats of :func:`consolidate_checkpoint`.
OUTPUT_FORMATS = ("safetensors", "torch")
# A memory-mapped shard is remapped after _REMAP_FACTOR * batch_bytes were read from it, so that pages already
# sent leave the resident set: re-parsing a safetensors header costs ~1 ms, re-unpickling a Megatron file
# (args, optimizer state, RNG states come along) ~20 ms, hence a wider window for torch files.
_REMAP_FACTOR = 1
_TORCH_REMAP_FACTOR = 4
_TENSOR_IN_MESSAGE = re.compile(r"tensor '([^']+)'")

Item = torch.Tensor | list[torch.Tensor]


class ConsolidationError(DistributeError, RuntimeError):
    """The consolidation failed on another rank (or in a spawned local rank).

    Attributes:
        cause: the originating error's message.
        rank: the global rank where it happened (``None`` when unknown).
        kind: the originating exception's type name, e.g. ``"MergeError"``.
    """

    def __init__(self, cause: str, rank: int | None = None, kind: str | None = None) -> None:
        super().__init__(cause, rank, kind)
        self.cause = cause
        self.rank = rank
        self.kind = kind

    def __str__(self) -> str:
        return self.cause if self.rank is None else f"{self.cause} (on rank {self.rank})"


@dataclass
class ConsolidationReport:
    """What a consolidation did; the same numbers on every rank (rank 0's), except ``rank``.

    Attributes:
        input_dir: the checkpoint read.
        output: the output directory or file given.
        layout: ``"own"`` or ``"megatron_legacy"``.
        tp: tensor-parallel size of the input.
        pp: pipeline-parallel size of the input.
        world_size: ranks that took part (1: consolidated in one process).
        format: output format, ``"safetensors"`` or ``"torch"``.
        tensors: tensors written.
        bytes: tensor bytes written.
        seconds: wall time on rank 0, from entry to the published output.
        transport: how shards travelled (``"shm"``, ``"workspace"``, ..., ``"none"`` in one process).
        rounds: pipeline rounds (batches of the largest stage).
        batch_bytes: merged bytes per stage and round.
        peak_rss_bytes: rank 0's peak resident set (``VmHWM``) at the end, 0 where unknown.
        files: the output files (index last when sharded).
        rank: the rank that returned this report.
        replaced: files of the same names that existed before and were replaced (the command line fills
            it in from its output check, ``--overwrite``); nothing else is ever removed.
    """

    input_dir: str
    output: str
    layout: str
    tp: int
    pp: int
    world_size: int
    format: str
    tensors: int
    bytes: int
    seconds: float
    transport: str
    rounds: int
    batch_bytes: int
    peak_rss_bytes: int
    files: list[str] = field(default_factory=list)
    rank: int = 0
    replaced: list[str] = field(default_factory=list)

    @property
    def mib_per_s(self) -> float:
        """Throughput in MiB/s (2**20 bytes per second), the unit of every report."""
        return self.bytes / self.seconds / 2**20 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with ``mib_per_s``)."""
        return {**asdict(self), "mib_per_s": self.mib_per_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConsolidationReport:
        """The inverse of :meth:`to_dict`."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self, wall_seconds: float | None = None) -> str:
        """A few human-readable lines (what the CLI prints); ``wall_seconds``: the whole command's time."""
        kind = _LAYOUT_NAMES.get(self.layout, self.layout)
        grid = "" if self.layout in _GLOBAL_LAYOUTS else f", TP {self.tp} x PP {self.pp}"
        files = ", ".join(self.files[:3]) + (f" (+{len(self.files) - 3} more)" if len(self.files) > 3 else "")
        rounds = f"{self.rounds} round{'' if self.rounds == 1 else 's'}"
        lines = [
            f"input:      {self.input_dir}: {kind}{grid}",
            f"ranks:      {self.world_size} (transport: {self.transport}; {rounds} of "
            f"<= {_mib(self.batch_bytes)} per stage)",
            f"written:    {self.tensors} tensors, {_mib(self.bytes)} in {self.seconds:.2f} s "
            f"({self.mib_per_s:.0f} MiB/s), format {self.format}",
            f"rank 0 peak memory (VmHWM): {_mib(self.peak_rss_bytes)}",
            f"output:     {files}",
        ]
        if self.replaced:
            lines.append(f"replaced:   {', '.join(self.replaced)} (the older files of these names)")
        if wall_seconds is not None:
            lines.append(f"wall time:  {wall_seconds:.2f} s (the whole command, start-up included)")
        return "\n".join(lines)


_LAYOUT_NAMES = {
    "own": "own (mesh.json)",
    "megatron_legacy": "Megatron-LM legacy",
    "megatron_torch_dist": "Megatron torch_dist (DCP)",
    "dcp": "torch.distributed.checkpoint",
}
_GLOBAL_LAYOUTS = ("megatron_torch_dist", "dcp")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _proc_status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM`` of ``/proc/self/status``), 0 where unknown."""
    return _proc_status_bytes("VmHWM")


# --------------------------------------------------------------------------------------------------------
# Planning (every rank, metadata only).


def resolve_rules(
    rules: RuleTable | str | os.PathLike[str] | None = None,
    quant_format: str | None = None,
    gated: bool | None = False,
) -> RuleTable:
    """The rule table to use.

    Args:
        rules: a table (used as is), a rules file (its patterns first, then the defaults, then its catch-all
            ``*`` line if any: :meth:`RuleTable.then`), or ``None``
            (the defaults).
        quant_format: ``None``, ``"fp8"``, ``"int8_sq"`` or ``"int4_awq"``: picks the default table.
        gated: whether the MLP is gated (SwiGLU), ``None`` if unknown (see :meth:`RuleTable.default`).

    Raises:
        RuleSyntaxError: a malformed rules file (``path:line:`` in the message).
        FileNotFoundError: no such rules file.
    """
    default = RuleTable.default(quant_format, gated)
    if rules is None:
        return default
    if isinstance(rules, RuleTable):
        return rules
    if isinstance(rules, (str, os.PathLike)):
        return RuleTable.from_file(rules).then(default)
    raise TypeError(f"rules must be a RuleTable, a rules file path or None; got {type(rules).__name__}")


def plan_checkpoint(
    input_dir: str | os.PathLike[str],
    rules: RuleTable | str | os.PathLike[str] | None = None,
    *,
    quant_format: str | None = None,
    layers_per_stage: Sequence[int] | None = None,
    iteration: int | str | None = None,
    swiglu: bool | None = None,
    names: str | None = None,
) -> tuple[Checkpoint, list[MergePlanEntry]]:
    """Opens a checkpoint and plans its consolidation from metadata; no collective, any process.

    Merge errors found while planning (e.g. shapes that cannot be concatenated) are extended with the stage
    and, for each TP rank, its global rank and shard file. ``swiglu`` overrides what the checkpoint says
    about its MLP (a Megatron checkpoint's ``args.swiglu``); ``names`` picks Megatron torch_dist's
    layer-norm names (``"te"`` or ``"local"``, default from its ``args``). A DCP checkpoint holds global
    tensors: ``rules`` and ``quant_format`` do not apply to it.

    Raises:
        FileNotFoundError: the directory or a shard file is missing (path named).
        LayoutError: not a known layout, or an inconsistent one.
        MergeError: the shards of a tensor cannot be merged (tensor, ranks and files named).
    """
    layout = open_checkpoint(input_dir, layers_per_stage, iteration, names=names)
    if isinstance(layout, DcpCheckpoint):
        if rules is not None or quant_format is not None:
            logger.info("%s holds global tensors: merge rules and quant_format do not apply", input_dir)
        return layout, layout.plan()
    table = resolve_rules(rules, quant_format, layout.gated_mlp if swiglu is None else swiglu)
    try:
        plan = plan_merge(layout, table)
    except MergeError as exc:
        raise MergeError(f"{exc}{_where(layout, str(exc))}") from None
    return layout, plan


def _where(layout: CheckpointLayout, message: str) -> str:
    """`` (stage p: TP rank t = global rank r in 'file', ...)`` for the tensor a message names."""
    m = _TENSOR_IN_MESSAGE.search(message)
    if m is None:
        return ""
    try:
        for s in range(layout.stages):
            for spec in layout.shard_specs(0, s):
                if layout.global_name(spec.name, s) == m.group(1):
                    shards = ", ".join(
                        f"TP rank {t} = global rank {r} in '{layout.file_for(t, s)}'"
                        for t, r in enumerate(layout.stage_ranks(s))
                    )
                    return f" ({layout.describe_stage(s)}: {shards})"
    except Exception:  # only decoration of an error message
        logger.debug("could not locate tensor %r", m.group(1), exc_info=True)
    return ""


def _make_batches(
    plan: Sequence[MergePlanEntry], pp: int, batch_bytes: int
) -> list[list[tuple[MergePlanEntry, ...]]]:
    """Per stage, its entries in plan order cut into batches of at most ``batch_bytes`` merged bytes."""
    stages: list[list[list[MergePlanEntry]]] = [[] for _ in range(pp)]
    sizes = [0] * pp
    for entry in plan:
        batches = stages[entry.pp_rank]
        p = entry.pp_rank
        if not batches or (batches[-1] and sizes[p] + entry.spec.nbytes > batch_bytes):
            batches.append([])
            sizes[p] = 0
        batches[-1].append(entry)
        sizes[p] += entry.spec.nbytes
    return [[tuple(b) for b in batches] for batches in stages]


def _plan_digest(plan: Sequence[MergePlanEntry], *parts: object) -> str:
    rows = [
        [e.name, e.pp_rank, e.local_name, str(e.rule), str(e.spec.dtype), list(e.spec.shape)] for e in plan
    ]
    return hashlib.blake2b(msgpack.packb([rows, [repr(p) for p in parts]]), digest_size=16).hexdigest()


def _check_space(output: str | os.PathLike[str], nbytes: int) -> None:
    """Fails early, naming the path, when the output's filesystem cannot hold ``nbytes``."""
    probe = Path(output).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise OSError(
            errno.ENOSPC,
            f"no space left for the consolidated checkpoint: it needs {nbytes:,} bytes, "
            f"the filesystem of '{probe}' has {free:,} free",
            os.fspath(output),
        )


# --------------------------------------------------------------------------------------------------------
# Per-rank building blocks.


class _ShardSource:
    """This rank's own shard, memory-mapped on first use (a DCP checkpoint: read batch by batch).

    The shard is remapped after about ``window`` bytes were taken from it, so that pages already sent or
    written leave this process's resident set.
    """

    def __init__(self, layout: CheckpointLayout, tp_rank: int, pp_rank: int, window: int) -> None:
        self._layout, self._tp, self._pp = layout, tp_rank, pp_rank
        self._window = window * (1 if layout.file_format == "safetensors" else _TORCH_REMAP_FACTOR)
        self._taken = 0
        self._tensors: dict[str, torch.Tensor] | None = None

    def get(self, entries: Sequence[MergePlanEntry]) -> list[torch.Tensor]:
        """The shards of ``entries`` (local names) in this rank's file."""
        if isinstance(self._layout, DcpCheckpoint):
            return self._layout.read(entries)
        if self._tensors is None:
            self._tensors = self._layout.load_shard(self._tp, self._pp)
        found = [self._tensors[e.local_name] for e in entries]
        self._taken += sum(t.numel() * t.element_size() for t in found)
        return found

    def batch_done(self) -> None:
        """Called after a batch's tensors were dropped: maybe unmap the shard."""
        if self._taken >= self._window:
            self._tensors = None
            self._taken = 0


@dataclass
class _Failure:
    """The first error seen by a rank: its own, or one forwarded from the rank that had it."""

    rank: int
    kind: str
    message: str
    exc: BaseException | None = None  # set on the originating rank only

    def wire(self) -> list[Any]:
        return [self.rank, self.kind, self.message]

    @classmethod
    def from_wire(cls, value: Sequence[Any]) -> _Failure:
        rank, kind, message = value
        return cls(int(rank), str(kind), str(message))

    def error(self, me: int) -> BaseException:
        if self.exc is not None and self.rank == me:
            return self.exc
        return ConsolidationError(self.message, self.rank, self.kind)


def _write(writer: CheckpointWriter, entry: MergePlanEntry, item: Item, ranks: Sequence[int]) -> None:
    """Writes one tensor (merged, or concat shards placed by the writer), naming the output on I/O errors."""
    try:
        if isinstance(item, torch.Tensor):
            writer.write(entry.name, item)
        else:
            write_merged(writer, entry.name, entry.rule, item, ranks)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot write tensor '{entry.name}' of the consolidated checkpoint: {exc.strerror or exc}",
            os.fspath(writer.directory),
        ) from exc


def _merge_for_forward(entry: MergePlanEntry, shards: list[torch.Tensor], ranks: Sequence[int]) -> Item:
    """What a stage's first TP rank sends to rank 0 for one tensor: concat shards as they are, else merged."""
    if len(shards) == 1:
        return shards[0]
    if isinstance(entry.rule, Concat):
        return shards
    return entry.rule.merge(entry.name, shards, ranks)


def _progress(total: int, enabled: bool, desc: str) -> Any:
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


class _BackgroundWriter:
    """Rank 0's writes, in a thread: senders fill round ``r + 1`` while round ``r`` is being written.

    ``submit`` blocks while ``depth`` rounds are already waiting, which bounds what rank 0 holds. A write
    error is kept and raised (once) by the next ``submit`` or by ``finish``; later batches are dropped.
    """

    def __init__(self, writer: CheckpointWriter, bar: Any, depth: int = 1) -> None:
        self._writer, self._bar = writer, bar
        self._queue: queue.Queue[list[tuple[MergePlanEntry, Item, list[int]]] | None] = queue.Queue(depth)
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
                        _write(self._writer, entry, item, ranks)
                        self._bar.update(entry.spec.nbytes)
                except BaseException as exc:
                    self._error = exc
            del tasks

    def _check(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def submit(self, tasks: list[tuple[MergePlanEntry, Item, list[int]]]) -> None:
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


@dataclass(frozen=True)
class _Options:
    """What a consolidation is asked to do, the same on every rank, whichever way it runs (one process, or
    one rank per shard): the plan's inputs and the output's shape."""

    format: str
    rules: RuleTable | str | os.PathLike[str] | None
    quant_format: str | None
    max_shard_size: int | None
    progress: bool
    batch_bytes: int
    layers_per_stage: Sequence[int] | None
    iteration: int | str | None
    swiglu: bool | None
    names: str | None

    def plan(self, input_dir: str | os.PathLike[str]) -> tuple[Checkpoint, list[MergePlanEntry]]:
        return plan_checkpoint(
            input_dir,
            self.rules,
            quant_format=self.quant_format,
            layers_per_stage=self.layers_per_stage,
            iteration=self.iteration,
            swiglu=self.swiglu,
            names=self.names,
        )

    def open_writer(self, output: str | os.PathLike[str], plan: Sequence[MergePlanEntry]) -> CheckpointWriter:
        _check_space(output, sum(e.spec.nbytes for e in plan))
        return open_writer(self.format, output, [e.spec for e in plan], self.max_shard_size)


# --------------------------------------------------------------------------------------------------------
# The job.


class _Job:
    """One consolidation as this process takes part in it: one rank's part of a TP x PP job (see the module
    doc for the call order), or, ``alone``, the whole of it (every shard read here, stage by stage).

    Both share the plan, the writer, the failure handling and the report; the roles differ only in where
    rank 0's batches come from and in their order: a job of ``tp * pp`` ranks moves batch ``r`` of every
    stage per round, one process reads one stage after the other (one stage's shard windows mapped at a
    time: memory stays near one batch).
    """

    def __init__(
        self,
        input_dir: str | os.PathLike[str],
        output: str | os.PathLike[str],
        options: _Options,
        *,
        workspace_path: str | os.PathLike[str] | None,
        transport: str,
        seconds: float,
        alone: bool,
    ) -> None:
        self.start = time.perf_counter()
        self.alone = alone
        self.input_dir, self.output, self.options = input_dir, output, options
        self.format, self.max_shard_size = options.format, options.max_shard_size
        self.seconds, self.batch_bytes = seconds, options.batch_bytes
        self.gather_options: dict[str, Any] = {
            "workspace_path": workspace_path,
            "transport": transport,
            "timeout": seconds,
        }
        self.workspace_path, self.transport = workspace_path, transport
        self.progress_enabled = options.progress
        self.rank = 0 if alone else dist.get_rank()
        self.world = 1 if alone else dist.get_world_size()
        self.failure: _Failure | None = None
        self.writer: CheckpointWriter | None = None
        self.bar: Any = None
        self._setup()

    # -- failures ------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, PeerLostError):
            raise exc
        if self.failure is None:
            self.failure = _Failure(self.rank, type(exc).__name__, one_line(exc), exc)
            logger.debug("rank %d failed; draining the remaining rounds", self.rank, exc_info=True)

    def _note(self, marker: Sequence[Any] | None) -> None:
        if marker is not None and self.failure is None:
            self.failure = _Failure.from_wire(marker)

    def _marker(self) -> list[Any] | None:
        return self.failure.wire() if self.failure is not None else None

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Records an error (draining from then on) instead of raising it; a lost peer is raised."""
        try:
            yield
        except Exception as exc:
            self._fail(exc)

    # -- setup -------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        if self.alone:
            self._plan()
            self.writer = self.options.open_writer(self.output, self.plan)
            self.transport_used = "none"
            return
        digest = ""
        with self._guard():
            self._plan()
            if isinstance(self.layout, DcpCheckpoint):
                raise ValueError(
                    f"'{self.input_dir}' is {self.layout.describe_grid()}: one process streams it from its "
                    f"files; run the consolidation on 1 rank, not {self.world}"
                )
            if self.world != self.tp * self.pp:
                raise ValueError(
                    f"'{self.input_dir}' is a {self.layout.describe_grid()} checkpoint and needs "
                    f"{self.tp * self.pp} ranks, but the world has {self.world}; run it on "
                    f"{self.tp * self.pp} ranks (or on 1 to consolidate in one process)"
                )
            self.pp_rank, self.tp_rank = self.layout.rank_grid.coordinate(self.rank)
            digest = _plan_digest(self.plan, self.format, self.max_shard_size, self.batch_bytes)
            self.source = _ShardSource(
                self.layout, self.tp_rank, self.pp_rank, _REMAP_FACTOR * self.batch_bytes
            )
            self.stage_ranks = self.layout.stage_ranks(self.pp_rank)
            if self.rank == 0:
                self.writer = self.options.open_writer(self.output, self.plan)
        statuses = sync.companion(None).exchange(
            msgpack.packb([digest, self._marker()]), self.seconds, what="starting the consolidation"
        )
        found = [msgpack.unpackb(s) for s in statuses]
        failed = [_Failure.from_wire(m) for _, m in found if m is not None]
        if not failed and any(d != found[0][0] for d, _ in found):
            differing = [r for r, (d, _) in enumerate(found) if d != found[0][0]]
            failed = [
                _Failure(
                    differing[0],
                    "ValueError",
                    f"{plural_list('rank', differing)} planned a different consolidation than rank 0; pass the same "
                    "checkpoint and options on every rank",
                )
            ]
        if failed:
            if self.writer is not None:
                self.writer.abort()
            mine = self.failure if self.failure is not None and self.failure.rank == failed[0].rank else None
            raise (mine or failed[0]).error(self.rank)
        self.mesh = ProcessGroupMesh(self.pp, self.tp, axis_names=("pp", "tp"), timeout=self.seconds)
        peers = sync.companion(None).peers(self.seconds)
        self.transport_used = _describe_transport(
            {p.shm_domain for p in peers}, self.transport, self.workspace_path is not None
        )
        logger.info(
            "rank %d (pp %d, tp %d): %d tensors, %d bytes, %d rounds over %s",
            self.rank,
            self.pp_rank,
            self.tp_rank,
            len(self.plan),
            self.total_bytes,
            self.rounds,
            self.transport_used,
        )

    def _plan(self) -> None:
        """The plan and its batches (metadata only), the same on every rank."""
        self.layout, self.plan = self.options.plan(self.input_dir)
        self.tp, self.pp = self.layout.tp, self.layout.stages
        self.batches = _make_batches(self.plan, self.pp, self.batch_bytes)
        self.rounds = max((len(b) for b in self.batches), default=0)
        self.total_bytes = sum(e.spec.nbytes for e in self.plan)

    # -- rounds --------------------------------------------------------------------------------------
    def _tp_round(self, batch: tuple[MergePlanEntry, ...]) -> list[list[torch.Tensor]] | None:
        """Step 1: gathers the batch's shards to the stage's first TP rank; per entry, shards in TP order.

        Returns ``None`` on the other TP ranks, and when this rank or a peer failed.
        """
        own: list[torch.Tensor] = []
        if self.failure is None:
            with self._guard():
                own = self.source.get(batch)
        if self.tp == 1:
            return [[t] for t in own] if self.failure is None else None
        payload = {"e": self._marker(), "t": own if self.failure is None else []}
        result: list[list[torch.Tensor]] | None = None
        with self._guard(), gather_configs(payload, self.mesh, "tp", **self.gather_options) as got:
            del payload, own
            if got:
                for part in got[1:]:
                    self._note(part["e"])
                if self.failure is None:
                    result = [[got[t]["t"][i] for t in range(self.tp)] for i in range(len(batch))]
        return result

    def _pp_send(self, batch: tuple[MergePlanEntry, ...] | None) -> None:
        """Steps 2-3 on a later stage's first TP rank: merge what needs merging, send the batch to rank 0."""
        items: list[Item] = []
        if batch is not None:
            shards = self._tp_round(batch)
            if shards is not None and self.failure is None:
                with self._guard():
                    items = [_merge_for_forward(e, s, self.stage_ranks) for e, s in zip(batch, shards)]
            del shards
        payload = {"e": self._marker(), "t": items if self.failure is None else []}
        del items
        with self._guard(), gather_configs(payload, self.mesh, "pp", **self.gather_options):
            pass
        self.source.batch_done()

    def _write_own(self, batch: tuple[MergePlanEntry, ...]) -> None:
        """Rank 0: its own stage's batch, handed to the writer thread (merged or placed into the output)."""
        shards = self._tp_round(batch)
        if shards is not None and self.failure is None:
            with self._guard():
                self.bg.submit(
                    [
                        (e, parts if len(parts) > 1 else parts[0], self.stage_ranks)
                        for e, parts in zip(batch, shards)
                    ]
                )
        del shards
        self.source.batch_done()

    def _receive_stages(self, r: int) -> None:
        """Rank 0, step 3: batch ``r`` of every later stage, handed to the writer thread as it arrives."""
        with (
            self._guard(),
            gather_configs({"e": None, "t": []}, self.mesh, "pp", **self.gather_options) as got,
        ):
            tasks: list[tuple[MergePlanEntry, Item, list[int]]] = []
            for p in range(1, self.pp):
                self._note(got[p]["e"])
                if self.failure is not None:
                    return
                batch = self.batches[p][r] if r < len(self.batches[p]) else ()
                items = got[p]["t"]
                if len(items) != len(batch):
                    raise RuntimeError(
                        f"stage {p} sent {len(items)} tensors in round {r}, expected {len(batch)}"
                    )
                ranks = self.layout.stage_ranks(p)
                tasks += [(entry, item, ranks) for entry, item in zip(batch, items)]
            self.bg.submit(tasks)

    def _read_alone(self) -> None:
        """Alone: every stage in turn, each batch read from every TP shard of the stage and written."""
        assert self.writer is not None
        streamed = isinstance(self.layout, DcpCheckpoint) and isinstance(self.writer, SafetensorsWriter)
        window = _REMAP_FACTOR * self.batch_bytes
        for p in range(self.pp):
            sources = [_ShardSource(self.layout, t, p, window) for t in range(self.tp)]
            ranks = self.layout.stage_ranks(p)
            for batch in self.batches[p]:
                if streamed:
                    self.layout.stream_into(self.writer, batch)  # chunk by chunk, no tensor built
                    self.bar.update(sum(e.spec.nbytes for e in batch))
                    continue
                shards = [s.get(batch) for s in sources]
                for i, entry in enumerate(batch):
                    parts = [s[i] for s in shards]
                    _write(self.writer, entry, parts if len(parts) > 1 else parts[0], ranks)
                    self.bar.update(entry.spec.nbytes)
                del shards
                for s in sources:
                    s.batch_done()

    def _run_first(self) -> None:
        """Rank 0: round by round, its own stage's batch and every later stage's, to the writer thread."""
        assert self.writer is not None
        mine = self.batches[0]
        self.bg = _BackgroundWriter(self.writer, self.bar)
        try:
            for r in range(self.rounds):
                if r < len(mine):
                    self._write_own(mine[r])
                if self.pp > 1:
                    self._receive_stages(r)
        except BaseException:
            self.bg.cancel()
            raise
        with self._guard():
            self.bg.finish()

    def _run_sender(self) -> None:
        """Any other rank: a stage's first TP rank sends every round to rank 0; the others their shards."""
        mine = self.batches[self.pp_rank]
        if self.tp_rank == 0:
            for r in range(self.rounds):
                self._pp_send(mine[r] if r < len(mine) else None)
        else:
            for batch in mine:
                self._tp_round(batch)
                self.source.batch_done()

    def run(self) -> ConsolidationReport:
        """Runs this process's role to the end, then agrees on the outcome with every rank."""
        self.bar = _progress(self.total_bytes, self.progress_enabled and self.rank == 0, "consolidating")
        try:
            if self.alone:
                self._read_alone()
            elif self.rank == 0:
                self._run_first()
            else:
                self._run_sender()
        except BaseException:
            if self.writer is not None:
                self.writer.abort()
            raise
        finally:
            self.bar.close()
        return self._finish()

    def _finish(self) -> ConsolidationReport:
        if self.alone:
            assert self.writer is not None
            try:
                files = [os.fspath(p) for p in self.writer.close()]
            except BaseException:
                self.writer.abort()
                raise
            return self._report(files)
        world = sync.companion(None)
        statuses = [
            msgpack.unpackb(s)
            for s in world.exchange(
                msgpack.packb(self._marker()), self.seconds, what="finishing the consolidation"
            )
        ]
        failures = [_Failure.from_wire(s) for s in statuses if s is not None]
        # Prefer a rank's own error over one it only forwarded.
        origin = next((f for r, f in enumerate(statuses) if f is not None and f[0] == r), None)
        failure = _Failure.from_wire(origin) if origin is not None else (failures[0] if failures else None)
        summary: dict[str, Any] | None = None
        if self.rank == 0:
            assert self.writer is not None
            if failure is None:
                try:
                    files = [os.fspath(p) for p in self.writer.close()]
                except Exception as exc:
                    self.writer.abort()
                    self._fail(exc)
                    failure = self.failure
                else:
                    summary = self._report(files).to_dict()
            else:
                self.writer.abort()
        result = world.exchange(
            msgpack.packb([failure.wire() if failure else None, summary] if self.rank == 0 else None),
            self.seconds,
            what="publishing the consolidation's result",
        )
        final_failure, final_summary = msgpack.unpackb(result[0])
        if final_failure is not None:
            raise self._error_for(_Failure.from_wire(final_failure))
        report = ConsolidationReport.from_dict(final_summary)
        report.rank = self.rank
        return report

    def _error_for(self, failure: _Failure) -> BaseException:
        if self.failure is not None and self.failure.exc is not None and self.failure.rank == failure.rank:
            return self.failure.exc
        return failure.error(self.rank)

    def _report(self, files: list[str]) -> ConsolidationReport:
        """The report of the finished consolidation (rank 0's)."""
        return ConsolidationReport(
            input_dir=os.fspath(self.input_dir),
            output=os.fspath(self.output),
            layout=self.layout.kind,
            tp=self.layout.tp,
            pp=self.layout.pp,
            world_size=self.world,
            format=self.format,
            tensors=len(self.plan),
            bytes=self.total_bytes,
            seconds=time.perf_counter() - self.start,
            transport=self.transport_used,
            rounds=self.rounds,
            batch_bytes=self.batch_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            files=files,
            rank=0,
        )


def _describe_transport(domains: set[str], requested: str, has_workspace: bool) -> str:
    if requested != "auto":
        return requested
    if len(domains) <= 1:
        return "shm"
    return f"shm within hosts + {'workspace' if has_workspace else 'collective'} across {len(domains)} hosts"


# --------------------------------------------------------------------------------------------------------
# Public entry points.


def consolidate_checkpoint(
    input_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    rules: RuleTable | str | os.PathLike[str] | None = None,
    quant_format: str | None = None,
    max_shard_size: int | str | None = None,
    workspace_path: str | os.PathLike[str] | None = None,
    transport: str = "auto",
    timeout: float | timedelta | None = None,
    progress: bool = True,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    layers_per_stage: Sequence[int] | None = None,
    iteration: int | str | None = None,
    swiglu: bool | None = None,
    names: str | None = None,
) -> ConsolidationReport:
    """Consolidates a sharded checkpoint into one checkpoint written by rank 0.

    Must be called on every rank of an initialised job whose world size equals ``tp * pp`` of the input,
    with the same arguments (the output path matters on rank 0 only). Rank ``pp_rank * tp + tp_rank``
    reads only the shard ``(tp_rank, pp_rank)``. Without an initialised process group, or in a world of
    one rank, the whole consolidation runs in this process instead (every shard read here, still tensor by
    tensor: memory stays near one batch).

    Args:
        input_dir: the checkpoint: own layout (``mesh.json``) or Megatron-LM legacy (``mp_rank_XX[_YYY]``).
        output: output directory (or a file path ending in ``.safetensors`` / ``.bin``), on rank 0.
        format: ``"safetensors"`` (streamed, nothing held) or ``"torch"`` (``torch.save``: each output
            file is held in memory until complete; bound it with ``max_shard_size``).
        rules: a :class:`RuleTable`, a rules file (tried before the defaults), or ``None`` (defaults).
        quant_format: ``None``, ``"fp8"``, ``"int8_sq"``, ``"int4_awq"``: the default rules' scale table.
        max_shard_size: bytes per output file (``"5GB"``, ``"500MiB"``, an int); ``None``: one file.
        workspace_path: a directory every rank can reach, for ranks on different hosts.
        transport: as in :func:`~distribute_utils.gather.gather_configs` (``"auto"``: shared memory within
            a host).
        timeout: bound on every wait, in seconds (default ``$DISTRIBUTE_UTILS_TIMEOUT`` or 600).
        progress: show a progress bar on rank 0 (tqdm, on stderr, when stderr is a terminal).
        batch_bytes: merged bytes per stage and round; rank 0 holds about one batch per stage.
        layers_per_stage: overrides the layer count per PP stage.
        iteration: Megatron only: the iteration (or ``"release"``) to read.
        swiglu: whether the MLP is gated; ``None``: as the checkpoint says (Megatron's ``args.swiglu``).
        names: Megatron torch_dist only: ``"te"`` or ``"local"`` layer-norm names (default from its args).

    Returns:
        The report (rank 0's numbers on every rank).

    Raises:
        FileNotFoundError: the checkpoint or a shard file is missing (path named).
        LayoutError: not a checkpoint, or an inconsistent one.
        MergeError: shards that cannot be merged (tensor and ranks named).
        OSError: the output cannot be written (path named), e.g. ``ENOSPC``.
        ValueError: the world size does not match ``tp * pp``, or bad arguments.
        ConsolidationError: on the other ranks, when one rank failed (its rank and cause named).
        PeerLostError: a rank stopped answering within ``timeout``.
    """
    if format not in OUTPUT_FORMATS:
        raise ValueError(f"unknown output format {format!r}; valid: {', '.join(OUTPUT_FORMATS)}")
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 1:
        raise ValueError(f"batch_bytes must be a positive int, got {batch_bytes!r}")
    options = _Options(
        format=format,
        rules=rules,
        quant_format=quant_format,
        max_shard_size=None if max_shard_size is None else parse_size(max_shard_size),
        progress=progress,
        batch_bytes=batch_bytes,
        layers_per_stage=layers_per_stage,
        iteration=iteration,
        swiglu=swiglu,
        names=names,
    )
    job = _Job(
        input_dir,
        output,
        options,
        workspace_path=workspace_path,
        transport=transport,
        seconds=sync.resolve_timeout(timeout),
        alone=not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1,
    )
    return job.run()


def _rank_main(
    input_dir: str, output: str, options: dict[str, Any], before: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """One spawned local rank: optional ``before()``, then :func:`consolidate_checkpoint` (errors returned).

    Returns ``{"before": ..., "report": dict}`` or ``{"before": ..., "error": [rank, kind, message]}``
    so that the launcher can report the originating rank's error rather than the first to arrive.
    """
    out: dict[str, Any] = {"before": before() if before is not None else None}
    try:
        out["report"] = consolidate_checkpoint(input_dir, output, **options).to_dict()
    except ConsolidationError as exc:
        out["error"] = [exc.rank, exc.kind or type(exc).__name__, exc.cause]
    except Exception as exc:
        logger.debug("consolidation failed", exc_info=True)
        out["error"] = [dist.get_rank(), type(exc).__name__, one_line(exc)]
    return out


def consolidate_local(
    input_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    nproc: int | None = None,
    launch_timeout: float | None = None,
    **options: Any,
) -> ConsolidationReport:
    """Consolidates in this process, or on ``nproc`` local ranks spawned for it (gloo, shared memory).

    What the CLI runs. Must be called in a plain process, outside any distributed job. ``nproc`` defaults
    to 1: one process streams every shard, memory-mapped, which on one host is faster and smaller than
    spawning ranks (docs/performance.md); ``nproc = tp * stages`` spawns one rank per shard.

    Args:
        input_dir: the checkpoint.
        output: the output directory or file.
        nproc: number of ranks: 1 (default) or ``tp * stages`` (``tp * pp * ep``).
        launch_timeout: bound on the whole run (seconds); ``None``: no bound beyond ``timeout``.
        **options: keyword arguments of :func:`consolidate_checkpoint`.

    Returns:
        Rank 0's report.

    Raises:
        ValueError: ``nproc`` is neither ``tp * pp`` nor 1.
        ConsolidationError: the consolidation failed; the originating rank, error type and cause.
        LaunchError: a rank died.
    """
    if nproc is None or nproc == 1:
        return consolidate_checkpoint(input_dir, output, **options)
    layout = open_checkpoint(
        input_dir, options.get("layers_per_stage"), options.get("iteration"), names=options.get("names")
    )
    needed = layout.tp * layout.stages
    if nproc != needed:
        raise ValueError(
            f"'{input_dir}' is a {layout.describe_grid()} checkpoint: it needs {needed} ranks "
            f"(or 1 for one process), not {nproc}"
        )
    report, _ = consolidate_on_local_ranks(input_dir, output, nproc, launch_timeout=launch_timeout, **options)
    return report


def consolidate_on_local_ranks(
    input_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    nproc: int,
    *,
    before: Callable[[], Any] | None = None,
    launch_timeout: float | None = None,
    **options: Any,
) -> tuple[ConsolidationReport, list[Any]]:
    """Spawns ``nproc`` local ranks (:func:`distribute_utils.launch.run_local`); each runs ``before()``
    (if given, e.g. the demo's mesh part), then :func:`consolidate_checkpoint`.

    Returns:
        Rank 0's report, and what ``before`` returned on each rank.

    Raises:
        ConsolidationError: the consolidation failed: the originating rank's error, not the first to arrive.
        LaunchError: a rank died; Interrupted: a rank was interrupted.
    """
    from ..launch import run_local

    results = run_local(
        _rank_main, nproc, os.fspath(input_dir), os.fspath(output), options, before, timeout=launch_timeout
    )
    errors = [r["error"] for r in results if r.get("error")]
    if errors:
        own = [e for i, e in enumerate(errors) if e[0] is not None and e[0] == i]
        rank, kind, message = (own or errors)[0]
        raise ConsolidationError(message, rank, kind)
    return ConsolidationReport.from_dict(results[0]["report"]), [r["before"] for r in results]
