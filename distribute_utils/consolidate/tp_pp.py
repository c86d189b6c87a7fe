"""Internal. Distributed consolidation of a TP x PP checkpoint into one checkpoint, streamed to rank 0.

The job has ``tp * pp`` ranks laid out as ``ProcessGroupMesh(pp, tp, axis_names=("pp", "tp"))``, so
``rank = pp_rank * tp + tp_rank`` (TP fastest, as Megatron numbers ranks), and rank ``(pp_i, tp_j)`` reads
only the shard ``(tp_j, pp_i)``, memory-mapped.

Planning: every rank opens the layout and plans from metadata alone (:func:`~.merge_plan.plan_merge`: shard
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

One process (no process group, or a world of one) runs :class:`~.local_job.LocalJob` instead: every stage
in turn, each batch read from all of the stage's TP shards and written in this thread (one stage's shard
windows mapped at a time, so memory stays near one batch); plan, writer and report are the ones the ranks
use.

Errors: a failure on any rank (a ``same`` tensor that differs, a full disk, a bad shard) does not leave the
others hanging: the failing rank keeps taking part in the remaining rounds with an error marker instead of
data, the marker travels to rank 0, rank 0 aborts its writer (nothing half-written is left), and a final
exchange makes every rank raise: the originating rank its own exception, the others
:class:`ConsolidationError` naming it. Only a lost peer (:class:`~distribute_utils.errors.PeerLostError`)
is raised at once (:mod:`.failures`).

The units, each depending only on those before it: :mod:`.report` (what a consolidation did),
:mod:`.plan` (rules, plan, batches, options; metadata only), :mod:`.reading` (a shard batch by batch),
:mod:`.failures`, :mod:`.job` (what both jobs share), :mod:`.local_job` and :mod:`.rank_job`, and this
module: the public entry points, which pick the job.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import sync
from ..errors import ArgumentError, one_line
from .failures import ConsolidationError
from .formats import open_checkpoint
from .hf_llama import HF_TARGETS, parse_given
from .job import Job
from .local_job import LocalJob
from .plan import Options, RuleChoice, plan_checkpoint, resolve_rules
from .rank_job import start_rank_job
from .report import ConsolidationReport, peak_rss_bytes
from .rule_table import RuleTable
from .specs import parse_size

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
    only: str | None = None,
    strip_prefix: str | None = None,
    to: str | None = None,
    hf_config: Mapping[str, Any] | Sequence[str] | None = None,
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
        only: write only the tensors whose names start with this (``"model."``: a DCP checkpoint's model,
            not its optimizer); what is left out is listed in the report.
        strip_prefix: remove this from the start of the names written (``"model."``: the output loads into
            the bare module).
        to: ``"hf"``: a Megatron GPT checkpoint of the Llama family written as a Hugging Face
            ``LlamaForCausalLM`` directory (``config.json`` and safetensors; see docs/consolidation.md);
            ``None``: the merged tensors under their own names.
        hf_config: with ``to="hf"``: facts the checkpoint lacks and the tokenizer's (``vocab_size``
            trims the padded vocabulary, ``eos_token_id``, ...), as a mapping or ``KEY=VALUE`` strings.

    Returns:
        The report (rank 0's numbers on every rank).

    Raises:
        FileNotFoundError: the checkpoint or a shard file is missing (path named).
        LayoutError: not a checkpoint, or an inconsistent one.
        MergeError: shards that cannot be merged (tensor and ranks named).
        OSError: the output cannot be written (path named), e.g. ``ENOSPC``.
        ValueError: the world size does not match ``tp * pp``, or bad arguments.
        ConversionError: ``to="hf"`` and the checkpoint is not what the converter knows, or lacks a fact.
        ConsolidationError: on the other ranks, when one rank failed (its rank and cause named).
        PeerLostError: a rank stopped answering within ``timeout``.
    """
    if format not in OUTPUT_FORMATS:
        raise ArgumentError(f"unknown output format {format!r}; valid: {', '.join(OUTPUT_FORMATS)}")
    if to is not None and to not in HF_TARGETS:
        raise ArgumentError(f"unknown conversion to={to!r}; valid: {', '.join(HF_TARGETS)} (or None)")
    if to is not None and format != "safetensors":
        raise ArgumentError(f"to={to!r} writes safetensors; format={format!r} cannot be asked with it")
    if hf_config and to is None:
        raise ArgumentError("hf_config is for to='hf'; pass to='hf' too")
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 1:
        raise ArgumentError(f"batch_bytes must be a positive int, got {batch_bytes!r}")
    options = Options(
        format=format,
        rules=RuleChoice(rules, quant_format, swiglu),
        max_shard_size=None if max_shard_size is None else parse_size(max_shard_size),
        progress=progress,
        batch_bytes=batch_bytes,
        layers_per_stage=layers_per_stage,
        iteration=iteration,
        names=names,
        only=only,
        strip_prefix=strip_prefix,
        to=to,
        hf_config=tuple(parse_given(hf_config).items()),
    )
    seconds = sync.resolve_timeout(timeout)
    job: Job
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        job = LocalJob(input_dir, output, options)
    else:
        job = start_rank_job(
            input_dir, output, options, workspace_path=workspace_path, transport=transport, seconds=seconds
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
        raise ArgumentError(
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
