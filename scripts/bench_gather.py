#!/usr/bin/env python3
"""Benchmark the shared-memory gather against ``torch.distributed`` and NVIDIA ModelOpt.

One invocation spawns ``--nproc`` local ranks (spawn start method, gloo over a ``TCPStore``
that this process hosts on a free port of 127.0.0.1) and measures, on the same ranks in one
run, every method barrier to barrier: a ``dist.barrier()`` before each timed repetition, the
time taken on rank 0 from after that barrier to the end of the method on rank 0 (the
method's own synchronisation included), median of the repetitions.

1. **bulk**: every rank holds one float32 tensor (64 MiB) that goes to rank 0: ours
   (``get_tensors_parallel``, ``transport="shm"``), ``dist.gather`` into preallocated outputs
   and into outputs allocated per call, ``dist.gather_object`` and ModelOpt's
   ``get_tensors_parallel``. Rank 0 touches one element of every received tensor (and, in the
   "+ read every byte" rows, all of them). Ours is checked bit for bit once.
2. **layer config**: per rank and layer a dict of 64 small tensors ((4096,), (128, 128), 0-d,
   bfloat16 (128,)) and scalar entries, gathered for 32 layers in a row, as ModelOpt's
   ``postprocess_model_config`` does; the time per layer. ModelOpt's helper carries only its
   own ``ModelConfig`` types, so it gets the same tensors inside a ``DecoderLayerConfig`` (ours
   is timed on those very objects too). It fails on 64 tensors (its segment size estimate
   leaves more than 64 KiB of slack and ``torch.load`` cannot find the zip directory): the
   row says so, and the case is repeated with 32 tensors, the most it carries.
3. **small round trip**: ``{"a": 1}`` on every rank, 200 rounds (ModelOpt: a
   ``LayernormConfig`` with a 1-element weight, its smallest config that works).
4. **memory**: rank 0's peak RSS growth during one bulk gather, over the bytes it receives.
   The kernel's high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs`` just
   before the call and read after it, so the peak is exact, not sampled.

5. **workspace** (``--workspace-case`` alone, or in a full run): ours through a shared directory
   (``transport="workspace"``: one file per sender) against ``torch.save`` by every sender +
   ``torch.load`` (plain and ``mmap=True``) by rank 0 through the same directory, for a bulk
   tensor and layer configs: on 4 local ranks with a directory on local disk, then on 2
   simulated hosts x 2 ranks (``scripts/simulate_nodes.py``, job
   ``scripts/bench_multinode_job.py``) over a shared directory and over sshfs, where the
   hierarchical gather (``transport="auto"``: one bundle file per remote host) is compared
   too. Repetitions of the methods are interleaved. Files created in the workspace per round
   are counted with inotify (the parent watches the job's namespace, created ahead with a
   fixed ``$DISTRIBUTE_UTILS_JOB_TOKEN``); bytes written per round are the sum of the ranks'
   ``/proc/self/io`` ``write_bytes`` (page-cache writes to disk or FUSE files; not tmpfs or
   sockets). ``--workspace-costs local|sshfs`` times each step in one process.

Where the time of a small round goes (the store protocol alone, the wire format, the library
around them) is measured by ``scripts/bench_latency.py``, through the public API only.

Usage::

    python scripts/bench_gather.py --json gather.json     # full run, several minutes on 2 cores
    python scripts/bench_gather.py --quick                # small sizes, no ModelOpt, < 60 s
    python scripts/bench_gather.py --workspace-case       # only case 5 (simulated nodes need root)
    python scripts/bench_gather.py --workspace-costs local # one process: each workspace step

The tables and PASS/FAIL lines against the targets go to stdout; ``--json`` writes everything
(every repetition's time, the memory breakdown, the environment). The exit status is 0 when
the benchmark ran, whatever the targets say. Segments left in ``/dev/shm`` by a crashed rank
(ours, or ModelOpt's fixed ``rank_*`` names) are removed at the end; the workspaces are
temporary directories, removed after their leftovers are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import gc
import json
import mmap
import os
import platform
import secrets
import select
import statistics
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import distribute_utils
from distribute_utils import barrier as store_barrier
from distribute_utils import get_configs_parallel, get_tensors_parallel
from distribute_utils.launch import run_local

MIB = 2**20
SHM_DIR = "/dev/shm"
_MADV_POPULATE_READ = 22  # Linux >= 5.14; not in Python's mmap module before 3.13
LAYER_TENSORS = 64
_LAYER_SHAPES: tuple[tuple[int, ...], ...] = ((4096,), (128, 128), (), (128,))
_LAYER_DTYPES = (torch.float32, torch.float32, torch.float32, torch.bfloat16)

# Where the 64 layer tensors go in a ModelOpt DecoderLayerConfig: 7 linears x 7 tensor fields,
# 5 layernorms x 2, the KV-cache scales and biases, and one gate tensor.
_MO_LINEARS = (
    "attention.qkv.q",
    "attention.qkv.k",
    "attention.qkv.v",
    "attention.dense",
    "mlp.fc",
    "mlp.gate",
    "mlp.proj",
)
_MO_LINEAR_FIELDS = (
    "weight",
    "bias",
    "activation_scaling_factor",
    "weights_scaling_factor",
    "weights_scaling_factor_2",
    "prequant_scaling_factor",
    "per_channel_scale",
)
_MO_LAYERNORMS = (
    "input_layernorm",
    "post_layernorm",
    "mlp_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
_MO_SLOTS: tuple[str, ...] = (
    *(f"{linear}.{name}" for linear in _MO_LINEARS for name in _MO_LINEAR_FIELDS),
    *(f"{norm}.{name}" for norm in _MO_LAYERNORMS for name in ("weight", "bias")),
    "attention.k_cache_bias",
    "attention.v_cache_bias",
    "attention.k_cache_scaling_factor",
    "attention.v_cache_scaling_factor",
    "gate_ffwd",
)
assert len(_MO_SLOTS) == LAYER_TENSORS

TARGETS = {
    "bulk_vs_modelopt": 6.0,
    "bulk_vs_dist_gather": 4.0,
    "layer_vs_modelopt": 3.0,
    "small_max_ms": 3.0,
    "memory_max_ratio": 1.2,
    "workspace_vs_save_load": 0.8,
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures; the same object reaches every rank."""

    nproc: int
    repeats: int
    warmup: int
    bulk_bytes: int
    layers: int
    small_rounds: int
    modelopt: bool
    quick: bool
    timeout_s: float
    groups: tuple[str, ...] = ("shm",)  # "shm": cases 1-4; "workspace": case 5
    workspace_dir: str | None = None  # local-disk workspace of case 5 (made by the parent)
    workspace_layers: int = 16  # layers in a row in the workspace layer-config cases
    workspace_repeats: int = 5  # timed repetitions per workspace method (each moves 3 x 64 MiB)
    multinode: tuple[str, ...] = ()  # simulated-node workspaces of case 5: "dir", "sshfs"


@dataclasses.dataclass
class Row:
    """One timed method of one case (times are rank 0's, in seconds)."""

    case: str
    key: str
    method: str
    times_s: list[float]
    compare_to: str | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """The row with its times in ms; ``median_ms`` is None when the method failed (see note)."""
        times_ms = [t * 1e3 for t in self.times_s]
        return {
            "case": self.case,
            "key": self.key,
            "method": self.method,
            "compare_to": self.compare_to,
            "note": self.note,
            "n": len(times_ms),
            "median_ms": statistics.median(times_ms) if times_ms else None,
            "min_ms": min(times_ms, default=None),
            "max_ms": max(times_ms, default=None),
            "times_ms": times_ms,
        }


@dataclasses.dataclass
class RankContext:
    """What every rank's measurement code needs."""

    rank: int
    world: int
    settings: Settings
    mo_distribute: Any | None = None  # modelopt.torch.export.distribute, when importable
    mo_config: Any | None = None  # modelopt.torch.export.model_config
    rows: list[Row] = dataclasses.field(default_factory=list)
    report: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world))

    @property
    def first(self) -> bool:
        return self.rank == 0

    def add(self, row: Row) -> None:
        if self.first:
            self.rows.append(row)


# ---------------------------------------------------------------------------------- helpers


def measure(fn: Callable[[], None], repeats: int, warmup: int) -> list[float]:
    """Run ``fn`` on every rank, a gloo barrier before each run; this rank's times after warm-up.

    Must be called on every rank. Each time runs from the end of the barrier to the end of
    ``fn`` on this rank.
    """
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return times


def touch(tensors: Sequence[torch.Tensor]) -> float:
    """Read one element (the last) of every tensor, so that results are really there."""
    return sum(float(t.reshape(-1)[-1]) for t in tensors if t.numel())


def read_all(tensors: Sequence[torch.Tensor]) -> int:
    """Read every byte of every 4-byte tensor (a max over its bits: no temporary tensor)."""
    return sum(int(t.view(torch.int32).max()) for t in tensors if t.numel())


def bulk_tensor(rank: int, nbytes: int) -> torch.Tensor:
    """Rank ``rank``'s bulk tensor: random float32 bit patterns (NaNs and all), reproducible."""
    gen = torch.Generator().manual_seed(1000 + rank)
    bits = torch.randint(-(2**31), 2**31, (nbytes // 4,), dtype=torch.int32, generator=gen)
    return bits.view(torch.float32)


def layer_config(rank: int, layer: int, n_tensors: int = LAYER_TENSORS) -> dict[str, Any]:
    """Rank ``rank``'s config of decoder layer ``layer``: ``n_tensors`` small tensors, scalar entries."""
    gen = torch.Generator().manual_seed(rank * 100_003 + layer)
    config: dict[str, Any] = {
        "name": f"layers.{layer}",
        "decoder_type": "llama",
        "hidden_act": "silu",
        "quantization": "fp8",
        "num_attention_heads": 32,
        "num_kv_heads": 8,
        "tp_rank": rank,
        "rotary_base": 10000.0,
        "eps": 1e-5,
    }
    for j in range(n_tensors):
        shape, dtype = _LAYER_SHAPES[j % 4], _LAYER_DTYPES[j % 4]
        config[f"tensor_{j:02d}"] = torch.randn(shape, generator=gen).to(dtype)
    return config


def layer_tensors(config: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a :func:`layer_config`, in order."""
    return [value for key, value in config.items() if key.startswith("tensor_")]


def modelopt_layer(config: dict[str, Any], mc: Any) -> Any:
    """The same tensors and scalars inside ModelOpt's ``DecoderLayerConfig`` (first slots first)."""
    layer = mc.DecoderLayerConfig(
        decoder_type=config["decoder_type"],
        num_attention_heads=config["num_attention_heads"],
        num_kv_heads=config["num_kv_heads"],
        rotary_base=int(config["rotary_base"]),
    )
    layer.attention = mc.AttentionConfig(
        qkv=mc.QKVConfig(q=mc.LinearConfig(), k=mc.LinearConfig(), v=mc.LinearConfig()),
        dense=mc.LinearConfig(),
    )
    layer.mlp = mc.MLPConfig(
        fc=mc.LinearConfig(), gate=mc.LinearConfig(), proj=mc.LinearConfig(), hidden_act="silu"
    )
    for norm in _MO_LAYERNORMS:
        setattr(layer, norm, mc.LayernormConfig(eps=config["eps"]))
    for slot, tensor in zip(_MO_SLOTS, layer_tensors(config)):
        *parents, name = slot.split(".")
        setattr(functools.reduce(getattr, parents, layer), name, tensor)
    return layer


def modelopt_touch(layers: Sequence[Any], n_tensors: int) -> float:
    """Touch the first and last tensor of each ModelOpt-shaped layer."""
    last = _MO_SLOTS[n_tensors - 1].split(".")
    return touch(
        [
            t
            for layer in layers
            for t in (layer.attention.qkv.q.weight, functools.reduce(getattr, last, layer))
        ]
    )


def dict_touch(configs: Sequence[dict[str, Any]], n_tensors: int) -> float:
    """Touch the first and last tensor of each dict-shaped layer."""
    last = f"tensor_{n_tensors - 1:02d}"
    return touch([t for config in configs for t in (config["tensor_00"], config[last])])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def proc_status() -> dict[str, int]:
    """This process's memory counters from ``/proc/self/status``, in bytes."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    found: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                found[key] = int(value.split()[0]) * 1024
    return found


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False when refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def exact_malloc_accounting() -> Any | None:
    """Make glibc map every allocation of 1 MiB or more and unmap it on free; return libc.

    glibc's adaptive threshold otherwise serves 8-32 MiB buffers from a heap whose freed pages
    stay resident, so a later buffer reuses them and the RSS does not grow by its size. Called
    only before the memory case, after every timed case. None where this is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3
        if not libc.mallopt(m_mmap_threshold, 1 * MIB):
            return None
    except (OSError, AttributeError):
        return None
    return libc


def import_modelopt() -> tuple[Any, Any] | str:
    """ModelOpt's ``distribute`` and ``model_config`` modules, or why they cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from modelopt.torch.export import distribute, model_config
    except Exception as exc:  # any import-time failure means "not available here"
        return f"{type(exc).__name__}: {exc}"
    return distribute, model_config


def median_ms(times: Sequence[float]) -> float:
    """Median of ``times`` (seconds), in milliseconds."""
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------------------------- cases


def bench_bulk(ctx: RankContext) -> None:
    """Case 1: one large float32 tensor per rank to rank 0."""
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    tensor = bulk_tensor(rank, s.bulk_bytes)
    case = f"bulk {ctx.world}x{s.bulk_bytes // MIB}MiB"

    # Correctness of ours, once, bit for bit.
    with get_tensors_parallel(tensor, ranks, transport="shm") as got:
        if ctx.first:
            exact = len(got) == ctx.world and all(
                same_bits(got[r], bulk_tensor(r, s.bulk_bytes)) for r in range(1, ctx.world)
            )
            ctx.report["verified_bulk_bit_exact"] = exact
            if not exact:
                raise AssertionError("ours returned different bytes than the ranks sent (bulk)")
            del got[:]

    def ours(consume: Callable[[Sequence[torch.Tensor]], object]) -> Callable[[], None]:
        def run() -> None:
            with get_tensors_parallel(tensor, ranks, transport="shm") as got:
                if got:
                    consume(got)

        return run

    outputs = [torch.empty_like(tensor) for _ in ranks] if ctx.first else None
    if outputs is not None:
        for out in outputs:
            out.zero_()  # fault the pages in once: "preallocated"

    def gather(consume: Callable[[Sequence[torch.Tensor]], object]) -> Callable[[], None]:
        def run() -> None:
            dist.gather(tensor, outputs, dst=0)
            if outputs is not None:
                consume(outputs)

        return run

    def gather_fresh() -> None:
        fresh = [torch.empty_like(tensor) for _ in ranks] if ctx.first else None
        dist.gather(tensor, fresh, dst=0)
        if fresh is not None:
            touch(fresh)

    def gather_object() -> None:
        objects: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(tensor, objects, dst=0)
        if objects is not None:
            touch(objects)

    reps, warm = s.repeats, s.warmup
    ctx.add(Row(case, "ours", "ours get_tensors_parallel (shm)", measure(ours(touch), reps, warm)))
    ctx.add(
        Row(case, "gather", "dist.gather (gloo, preallocated)", measure(gather(touch), reps, warm), "ours")
    )
    ctx.add(
        Row(
            case,
            "gather_fresh",
            "dist.gather (gloo, outputs allocated per call)",
            measure(gather_fresh, reps, warm),
            "ours",
        )
    )
    ctx.add(Row(case, "gather_object", "dist.gather_object", measure(gather_object, reps, warm), "ours"))
    if ctx.mo_distribute is not None:
        mo = ctx.mo_distribute

        def modelopt() -> None:
            with mo.get_tensors_parallel(tensor, ranks, None) as got:
                if got:
                    touch(got)

        ctx.add(Row(case, "modelopt", "ModelOpt get_tensors_parallel", measure(modelopt, reps, warm), "ours"))
    ctx.add(Row(case, "ours_read", "ours + read every byte", measure(ours(read_all), reps, warm)))
    ctx.add(
        Row(
            case,
            "gather_read",
            "dist.gather + read every byte",
            measure(gather(read_all), reps, warm),
            "ours_read",
        )
    )


def bench_layers(ctx: RankContext, n_tensors: int) -> None:
    """Case 2: ``layers`` decoder-layer configs in a row, ``n_tensors`` tensors each; time per layer."""
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    configs = [layer_config(rank, i, n_tensors) for i in range(s.layers)]
    case = f"layer config ({n_tensors} tensors), per layer"

    with get_configs_parallel(configs[0], ranks, None, transport="shm") as got:
        if ctx.first:
            exact = len(got) == ctx.world
            for r in range(1, ctx.world):
                want = layer_config(r, 0, n_tensors)
                exact = exact and list(got[r]) == list(want)
                for key, value in want.items():
                    mine = got[r][key]
                    ok = same_bits(mine, value) if isinstance(value, torch.Tensor) else mine == value
                    exact = exact and ok
            ctx.report[f"verified_layer_{n_tensors}_bit_exact"] = exact
            if not exact:
                raise AssertionError(f"ours returned a different config than the ranks sent ({case})")

    def per_layer(fn: Callable[[], None]) -> list[float]:
        return [t / s.layers for t in measure(fn, s.repeats, s.warmup)]

    def ours() -> None:
        for config in configs:
            with get_configs_parallel(config, ranks, None, transport="shm") as got:
                if got:
                    dict_touch(got, n_tensors)

    def gather_object() -> None:
        for config in configs:
            objects: list[Any] | None = [None] * ctx.world if ctx.first else None
            dist.gather_object(config, objects, dst=0)
            if objects is not None:
                dict_touch(objects, n_tensors)

    ctx.add(Row(case, "ours", "ours get_configs_parallel (dict)", per_layer(ours)))
    ctx.add(Row(case, "gather_object", "dist.gather_object (dict)", per_layer(gather_object), "ours"))
    if ctx.mo_distribute is None:
        return
    mo, mc = ctx.mo_distribute, ctx.mo_config
    mo_layers = [modelopt_layer(config, mc) for config in configs]

    def ours_dataclass() -> None:
        for layer in mo_layers:
            with get_configs_parallel(layer, ranks, None, transport="shm") as got:
                if got:
                    modelopt_touch(got, n_tensors)

    ctx.add(
        Row(
            case,
            "ours_dc",
            "ours get_configs_parallel (DecoderLayerConfig)",
            per_layer(ours_dataclass),
            note="the very objects ModelOpt gets",
        )
    )

    def modelopt() -> None:
        for layer in mo_layers:
            with mo.get_configs_parallel(layer, ranks, None) as got:
                if got:
                    modelopt_touch(got, n_tensors)

    label = "ModelOpt get_configs_parallel (DecoderLayerConfig)"
    error = modelopt_attempt(ctx, lambda: modelopt_config_round(mo, mo_layers[0], ranks))
    if error is None:
        ctx.add(Row(case, "modelopt", label, per_layer(modelopt), "ours_dc"))
    else:
        ctx.add(Row(case, "modelopt", label, [], "ours_dc", note=f"fails: {error}"))


def modelopt_config_round(mo: Any, config: Any, ranks: list[int]) -> None:
    """One ModelOpt ``get_configs_parallel`` round, recovering the ranks when rank 0's read fails.

    ModelOpt sizes its segment by estimate (2 KiB per tensor); ``torch.load`` looks for the zip
    directory in the last 64 KiB and fails on a config of more than ~36 tensors ("failed finding
    central directory"). The failure is raised on rank 0 inside ModelOpt's ``__enter__``, while
    the senders already wait in its closing barrier: rank 0 joins that barrier, so the senders
    unlink their segments, and re-raises.
    """
    try:
        with mo.get_configs_parallel(config, ranks, None):
            pass
    except Exception:
        if dist.get_rank() == ranks[0]:
            dist.barrier()
        raise


def modelopt_attempt(ctx: RankContext, attempt: Callable[[], None]) -> str | None:
    """Run ``attempt`` on every rank; the first error any rank saw (agreed everywhere), or None."""
    error = None
    try:
        attempt()
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0].split('. ')[0][:160]}"
    errors: list[str | None] = [None] * ctx.world
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def bench_small(ctx: RankContext) -> None:
    """Case 3: a tiny config, many rounds, each timed barrier to barrier."""
    s, ranks = ctx.settings, ctx.ranks
    case = "small round trip"
    small = {"a": 1}
    rounds, warm = s.small_rounds, max(5, s.warmup)

    def ours() -> None:
        with get_configs_parallel(small, ranks, None, transport="shm") as got:
            if got and got[-1] != small:
                raise AssertionError(f"ours returned {got[-1]!r} for {small!r}")

    def gather_object() -> None:
        objects: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(small, objects, dst=0)

    ctx.add(Row(case, "ours", 'ours get_configs_parallel {"a": 1}', measure(ours, rounds, warm)))
    ctx.add(Row(case, "gather_object", "dist.gather_object", measure(gather_object, rounds, warm), "ours"))
    if ctx.mo_distribute is not None:
        # ModelOpt sizes the segment of a config without tensors with no room for the torch.save
        # of its (empty) weights and fails ("data out of range"): give it one 1-element tensor.
        mo, tiny = ctx.mo_distribute, ctx.mo_config.LayernormConfig(weight=torch.ones(1), eps=1e-5)

        def modelopt() -> None:
            with mo.get_configs_parallel(tiny, ranks, None) as got:
                if got:
                    _ = got[-1].eps

        ctx.add(
            Row(
                case,
                "modelopt",
                "ModelOpt get_configs_parallel",
                measure(modelopt, rounds, warm),
                "ours",
                note="LayernormConfig with a 1-element weight: it carries ModelConfig types only",
            )
        )
    ctx.add(Row(case, "gloo_barrier", "reference: dist.barrier (gloo)", measure(dist.barrier, rounds, warm)))
    ctx.add(
        Row(
            case,
            "store_barrier",
            "reference: distribute_utils.barrier (store)",
            measure(store_barrier, rounds, warm),
        )
    )


def bench_memory(ctx: RankContext) -> None:
    """Case 4: rank 0's peak RSS growth during one bulk gather, per received byte."""
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    tensor = bulk_tensor(rank, s.bulk_bytes)
    received = (ctx.world - 1) * s.bulk_bytes
    results: list[dict[str, Any]] = []
    libc = exact_malloc_accounting()

    def one(key: str, method: str, run: Callable[[Callable[..., None]], None]) -> None:
        held: dict[str, int] = {}

        def consume(tensors: Sequence[torch.Tensor], *, everything: bool = True) -> None:
            if everything:
                read_all(tensors)
            else:
                touch(tensors)
            held.update(proc_status())

        gc.collect()
        if libc is not None:
            libc.malloc_trim(0)
        dist.barrier()
        base = proc_status()
        exact = reset_peak_rss() if ctx.first else False
        run(consume)
        after = proc_status()
        dist.barrier()
        if not ctx.first:
            return
        peak = (after["VmHWM"] if exact else max(held.get("VmRSS", 0), after["VmRSS"])) - base["VmRSS"]
        results.append(
            {
                "key": key,
                "method": method,
                "received_bytes": received,
                "peak_growth_bytes": peak,
                "ratio": peak / received,
                "peak_exact": exact,
                "held_anon_bytes": held.get("RssAnon", 0) - base["RssAnon"],
                "held_shmem_bytes": held.get("RssShmem", 0) - base["RssShmem"],
                "left_after_bytes": after["VmRSS"] - base["VmRSS"],
            }
        )

    def ours(everything: bool) -> Callable[[Callable[..., None]], None]:
        def run(consume: Callable[..., None]) -> None:
            with get_tensors_parallel(tensor, ranks, transport="shm") as got:
                if got:
                    consume(got[1:], everything=everything)

        return run

    def gather(consume: Callable[..., None]) -> None:
        outputs = [torch.empty_like(tensor) for _ in ranks] if ctx.first else None
        dist.gather(tensor, outputs, dst=0)
        if outputs is not None:
            consume(outputs[1:])

    def gather_object(consume: Callable[..., None]) -> None:
        objects: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(tensor, objects, dst=0)
        if objects is not None:
            consume(objects[1:])

    one("ours", "ours get_tensors_parallel, reads every byte", ours(True))
    one("ours_touch", "ours get_tensors_parallel, touches one element", ours(False))
    one("gather", "dist.gather (outputs allocated in the call)", gather)
    one("gather_object", "dist.gather_object", gather_object)
    if ctx.mo_distribute is not None:
        mo = ctx.mo_distribute

        def modelopt(consume: Callable[..., None]) -> None:
            with mo.get_tensors_parallel(tensor, ranks, None) as got:
                if got:
                    consume(got[1:])

        one("modelopt", "ModelOpt get_tensors_parallel", modelopt)
    if ctx.first:
        ctx.report["memory"] = results


# ---------------------------------------------------------------------------------- workspace

WS_BASELINE_DIR = "bench-baseline"
"""Subdirectory of the workspace for the torch.save files (and the case markers)."""
WS_MARK_PREFIX = ".mark-"
WS_METHODS = {
    "ours": 'ours, transport="workspace" (flat)',
    "ours_nofsync": 'ours, transport="workspace", fsync off (patched)',
    "ours_auto": 'ours, transport="auto" (hierarchical)',
    "save_load": "torch.save -> torch.load",
    "save_load_mmap": "torch.save -> torch.load(mmap=True)",
}
_IO_FIELDS = ("write_bytes", "read_bytes", "cancelled_write_bytes", "wchar", "rchar")


@dataclasses.dataclass(frozen=True)
class WorkspaceSetup:
    """Where and how one rank runs the workspace cases."""

    where: str  # label of the filesystem/topology, part of the case names
    workspace: str  # the workspace_path every rank passes (the same directory everywhere)
    methods: tuple[str, ...]  # keys of WS_METHODS, "ours" first
    read_every_byte: bool  # rank 0 reads every byte (network filesystems) or touches one element

    @property
    def baseline_dir(self) -> str:
        return os.path.join(self.workspace, WS_BASELINE_DIR)


def read_io() -> dict[str, int]:
    """This process's I/O counters from ``/proc/self/io``.

    ``write_bytes`` counts the bytes of file pages this task dirtied (page granularity) on
    filesystems with writeback: ext4, xfs, NFS and FUSE (sshfs) count, tmpfs (``/dev/shm``)
    and sockets do not; ``wchar`` counts every byte passed to a write system call.
    """
    found = dict.fromkeys(_IO_FIELDS, 0)
    with contextlib.suppress(OSError), open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in found:
                found[key] = int(value)
    return found


def read_every_byte(tensors: Sequence[torch.Tensor]) -> int:
    """Read every byte of any tensors (4-byte words where the size allows)."""
    total = 0
    for t in tensors:
        if not t.numel():
            continue
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0:
            total += int(flat.view(torch.int32).max())
        else:
            total += int(flat.max())
    return total


def _config_tensors(configs: Sequence[Any]) -> list[torch.Tensor]:
    return [v for c in configs for v in c.values() if isinstance(v, torch.Tensor)]


@contextlib.contextmanager
def _workspace_fsync_off() -> Iterator[None]:
    """Make every ``WorkspaceTransport`` of this process skip ``fsync`` (a what-if, not an API)."""
    from distribute_utils.transports import workspace as ws

    cls = ws.WorkspaceTransport
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["fsync"] = False
        original(self, *args, **kwargs)

    cls.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__init__ = original  # type: ignore[method-assign]


def _ws_runner(
    ctx: RankContext, setup: WorkspaceSetup, key: str, values: Sequence[Any], names: Iterator[int]
) -> Callable[[Callable[[list[Any], int], None]], None]:
    """One repetition of method ``key``: every value of ``values`` gathered to rank 0 in turn.

    The returned function takes ``consume(got, index)``, called on rank 0 with the gathered
    list of value ``index``. ``names`` numbers the torch.save files (the same on every rank).
    """
    ranks, rank, first = ctx.ranks, ctx.rank, ctx.ranks[0]
    if key.startswith("ours"):
        transport = "auto" if key == "ours_auto" else "workspace"

        def ours(consume: Callable[[list[Any], int], None]) -> None:
            with _workspace_fsync_off() if key == "ours_nofsync" else contextlib.nullcontext():
                for i, value in enumerate(values):
                    if isinstance(value, torch.Tensor):
                        gather = get_tensors_parallel(
                            value, ranks, workspace_path=setup.workspace, transport=transport
                        )
                    else:
                        gather = get_configs_parallel(
                            value, ranks, None, setup.workspace, transport=transport
                        )
                    with gather as got:
                        if got:
                            consume(got, i)

        return ours

    use_mmap = key == "save_load_mmap"

    def save_load(consume: Callable[[list[Any], int], None]) -> None:
        # ModelOpt's NFS path: every sender torch.saves into the shared directory, barrier, the
        # first rank torch.loads each file. Fresh names per round (ModelOpt rewrites one name per
        # rank, which a network client's attribute cache can serve stale); the reader unlinks.
        for i, value in enumerate(values):
            n = next(names)

            def path(r: int, n: int = n) -> str:
                return os.path.join(setup.baseline_dir, f"{key}-{n}-r{r}.pth")

            if rank != first:
                torch.save(value, path(rank))
            dist.barrier()
            if rank == first:
                got = [value]
                for r in ranks[1:]:
                    got.append(torch.load(path(r), map_location="cpu", weights_only=True, mmap=use_mmap))
                    os.unlink(path(r))
                consume(got, i)

    return save_load


class _Marks:
    """Rank 0 creates an empty marker file before and after each method's timed repetitions.

    The parent watches the directory with inotify and attributes the files created between a
    start marker and the next marker to that method (see :class:`FileEvents`).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.made: dict[str, str | None] = {}  # marker name -> "case|key" (None: an end marker)

    def mark(self, label: str | None) -> None:
        name = f"{WS_MARK_PREFIX}{len(self.made):04d}"
        fd = os.open(os.path.join(self.directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        self.made[name] = label

    def remove(self) -> None:
        for name in self.made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))


def bench_workspace(ctx: RankContext, setup: WorkspaceSetup) -> None:
    """Case 5: the workspace transport against torch.save + torch.load through the same directory.

    Two cases, as 1 and 2: a bulk tensor per rank, and ``workspace_layers`` layer configs in a
    row (time per layer). Every method first runs ``warmup`` untimed repetitions (the first
    checks rank 0's results bit for bit). The timed repetitions are interleaved: repetition
    ``k`` runs every method once, in an order rotated by ``k``, so that all methods see the
    same background load (the machine is shared). Each is timed barrier to barrier on rank 0.
    Around each timed repetition every rank reads its ``/proc/self/io`` counters (bytes written
    into the workspace) and rank 0 drops markers for the parent's file counter.
    """
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    if ctx.first:
        os.makedirs(setup.baseline_dir, exist_ok=True)
    dist.barrier()
    marks = _Marks(setup.baseline_dir) if ctx.first else None
    names = iter(range(10**9))
    consume_tensors = read_every_byte if setup.read_every_byte else touch
    bulk = [bulk_tensor(rank, s.bulk_bytes)]
    layers = [layer_config(rank, i) for i in range(s.workspace_layers)]
    cases = [
        (f"workspace, {setup.where}: bulk {ctx.world}x{s.bulk_bytes // MIB}MiB", bulk),
        (f"workspace, {setup.where}: layer config, per layer", layers),
    ]
    io_report = ctx.report.setdefault("workspace_io", {})
    verified = ctx.report.setdefault("workspace_verified", {})
    for case, values in cases:
        is_tensor = isinstance(values[0], torch.Tensor)
        wrong: list[str] = []

        def check(got: list[Any], i: int, is_tensor: bool = is_tensor, wrong: list[str] = wrong) -> None:
            for r, value in zip(ranks, got):
                if is_tensor:
                    if not same_bits(value, bulk_tensor(r, s.bulk_bytes)):
                        wrong.append(f"rank {r}")
                    continue
                want = layer_config(r, i)
                same = list(value) == list(want) and all(
                    same_bits(value[k], v) if isinstance(v, torch.Tensor) else value[k] == v
                    for k, v in want.items()
                )
                if not same:
                    wrong.append(f"rank {r} layer {i}")

        def consume(got: list[Any], i: int, is_tensor: bool = is_tensor) -> None:
            if is_tensor:
                consume_tensors(got)
            elif setup.read_every_byte:
                read_every_byte(_config_tensors(got))
            else:
                dict_touch(got, LAYER_TENSORS)

        runners = {key: _ws_runner(ctx, setup, key, values, names) for key in setup.methods}
        for key, run in runners.items():
            del wrong[:]
            for i in range(s.warmup):
                dist.barrier()
                run(check if i == 0 else consume)
            if ctx.first:
                verified[f"{case}|{key}"] = list(wrong) or True
        times: dict[str, list[float]] = {key: [] for key in runners}
        written = {key: dict.fromkeys(_IO_FIELDS, 0) for key in runners}
        order = list(runners)
        for k in range(s.workspace_repeats):
            for key in order[k % len(order) :] + order[: k % len(order)]:
                if marks is not None:
                    marks.mark(f"{case}|{key}")
                before = read_io()
                dist.barrier()
                start = time.perf_counter()
                runners[key](consume)
                times[key].append((time.perf_counter() - start) / len(values))
                after = read_io()
                if marks is not None:
                    marks.mark(None)
                for name in _IO_FIELDS:
                    written[key][name] += after[name] - before[name]
        per_rank: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(written, per_rank, dst=ranks[0])
        for key in runners:
            ctx.add(Row(case, key, WS_METHODS[key], times[key], None if key == "ours" else "ours"))
            if per_rank is not None:
                io_report[f"{case}|{key}"] = {
                    "per_rank": [counters[key] for counters in per_rank],
                    "rounds": s.workspace_repeats * len(values),
                }
        del runners
        gc.collect()
    dist.barrier()
    if marks is not None:
        ctx.report.setdefault("workspace_marks", {}).update(marks.made)
        marks.remove()
        with contextlib.suppress(OSError):
            os.rmdir(setup.baseline_dir)


# ---------------------------------------------------------------------------------- ranks


def rank_main(settings: Settings) -> dict[str, Any]:
    """One rank (started by :func:`distribute_utils.launch.run_local`, in its gloo group): run every
    case; rank 0 returns the report, the others ``{}``."""
    rank = dist.get_rank()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(settings.nproc), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    ctx = RankContext(rank, settings.nproc, settings)
    if settings.modelopt:
        found = import_modelopt()
        flags = [None] * settings.nproc
        dist.all_gather_object(flags, isinstance(found, str))
        if isinstance(found, str) or any(flags):
            ctx.report["modelopt_skipped"] = (
                found if isinstance(found, str) else "not importable on every rank"
            )
        else:
            ctx.mo_distribute, ctx.mo_config = found
    steps: list[tuple[str, Callable[[RankContext], None]]] = []
    if "shm" in settings.groups:
        steps += [
            ("bulk", bench_bulk),
            ("layer config", functools.partial(bench_layers, n_tensors=LAYER_TENSORS)),
            ("small round trip", bench_small),
        ]
        if ctx.mo_distribute is not None:  # the largest layer ModelOpt's helper can carry
            steps.insert(
                2, ("layer config (ModelOpt-sized)", functools.partial(bench_layers, n_tensors=32))
            )
    if "workspace" in settings.groups and settings.workspace_dir is not None:
        local = WorkspaceSetup(
            f"local disk 1x{settings.nproc}",
            settings.workspace_dir,
            ("ours", "ours_nofsync", "save_load", "save_load_mmap"),
            read_every_byte=False,
        )
        steps.append(("workspace (local disk)", functools.partial(bench_workspace, setup=local)))
    if "shm" in settings.groups:
        steps.append(("memory", bench_memory))  # last: it changes malloc's settings
    for name, step in steps:
        started = time.perf_counter()
        step(ctx)
        gc.collect()
        if ctx.first:
            print(f"[bench_gather] {name}: done in {time.perf_counter() - started:.1f} s", flush=True)
    dist.barrier()
    if ctx.first:
        ctx.report["rows"] = [row.to_json() for row in ctx.rows]
        return ctx.report
    return {}


# ---------------------------------------------------------------------------------- write costs


def write_costs(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """One process alone: what moving ``nbytes`` through a ``/dev/shm`` segment costs, step by step.

    The sender's ways of filling a fresh segment (ours is ``posix_fallocate`` + ``pwritev``),
    the same write into pages already allocated and touched (a reused segment), and the reader's
    first read through a fresh mapping (page faults) against alternatives. Median and minimum of
    ``repeats``; segments are removed as it goes.
    """
    source = bulk_tensor(0, nbytes).view(torch.int32)
    data = memoryview((ctypes.c_ubyte * nbytes).from_address(source.data_ptr())).cast("B")
    path = os.path.join(SHM_DIR, f"bench_gather_costs_{os.getpid()}")
    results: list[dict[str, Any]] = []

    def record(name: str, times: list[float]) -> None:
        best = min(times)
        results.append(
            {
                "step": name,
                "median_ms": median_ms(times),
                "min_ms": best * 1e3,
                "gib_per_s_at_min": nbytes / 2**30 / best,
            }
        )

    @contextlib.contextmanager
    def segment(written: bool) -> Iterator[int]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if written:
                os.pwritev(fd, [data], 0)
            yield fd
        finally:
            os.close(fd)
            os.unlink(path)

    def fresh(step: Callable[[int], object]) -> list[float]:
        times = []
        for _ in range(repeats):
            with segment(written=False) as fd:
                start = time.perf_counter()
                step(fd)
                times.append(time.perf_counter() - start)
        return times

    record("sender: posix_fallocate of a fresh segment", fresh(lambda fd: os.posix_fallocate(fd, 0, nbytes)))
    record(
        "sender: posix_fallocate + pwritev (ours)",
        fresh(lambda fd: (os.posix_fallocate(fd, 0, nbytes), os.pwritev(fd, [data], 0))),
    )
    record("sender: pwritev alone (the file grows)", fresh(lambda fd: os.pwritev(fd, [data], 0)))
    with segment(written=True) as fd:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            os.pwritev(fd, [data], 0)
            times.append(time.perf_counter() - start)
        record("sender: pwritev into touched pages (a reused segment)", times)

        def first_read(flags: int, populate: bool) -> list[float]:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                if populate:
                    mapping.madvise(_MADV_POPULATE_READ)
                view = torch.frombuffer(mapping, dtype=torch.int32)
                read_all([view])
                times.append(time.perf_counter() - start)
                del view
                mapping.close()
            return times

        record(
            "reader: map MAP_PRIVATE + first read (ours, page faults)", first_read(mmap.MAP_PRIVATE, False)
        )
        record("reader: map MAP_PRIVATE + MADV_POPULATE_READ + read", first_read(mmap.MAP_PRIVATE, True))
        record(
            "reader: map MAP_PRIVATE | MAP_POPULATE + read (copies)",
            first_read(mmap.MAP_PRIVATE | mmap.MAP_POPULATE, False),
        )
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read_all([source])
        times.append(time.perf_counter() - start)
    record("reader: read of pages already mapped (anonymous tensor)", times)
    return results


def format_write_costs(results: list[dict[str, Any]], nbytes: int, where: str = f"through {SHM_DIR}") -> str:
    """The table of :func:`write_costs` (and of :func:`workspace_costs`)."""
    lines = [f"moving {nbytes // MIB} MiB {where}, one process alone"]
    width = max(58, *(len(r["step"]) for r in results))
    header = f"{'step':<{width}} {'median ms':>10} {'min ms':>8} {'GiB/s at min':>13}"
    lines += [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['step']:<{width}} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} {r['gib_per_s_at_min']:>13.2f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- workspace costs


def workspace_costs(writer_dir: str, reader_dir: str, nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """One process alone: each step of moving ``nbytes`` through a workspace directory.

    The sender's steps of ours (encode with and without the CRC-32; create; ``fallocate``;
    ``pwritev``; ``fsync``; close + rename), then ours end to end (``WorkspaceTransport.publish``
    with and without ``fsync``, ``fetch`` through ``reader_dir``, ``wire.decode`` with the
    checksum verified), against ``torch.save`` and ``torch.load`` (plain, ``mmap=True``) of the
    same tensor. ``writer_dir`` and ``reader_dir`` name the same directory (two mounts of one
    share, or twice the same path). Median and minimum of ``repeats``; files removed as it goes.
    """
    from distribute_utils import wire
    from distribute_utils.transports import files as wsfiles
    from distribute_utils.transports import workspace as ws

    tensor = bulk_tensor(0, nbytes)
    results: list[dict[str, Any]] = []
    counter = iter(range(10**9))

    def record(name: str, times: list[float]) -> None:
        best = min(times)
        results.append(
            {
                "step": name,
                "median_ms": median_ms(times),
                "min_ms": best * 1e3,
                "gib_per_s_at_min": nbytes / 2**30 / best,
            }
        )

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    record(
        "encode, CRC-32 computed",
        [timed(lambda: wire.encode(tensor, root="tensor", checksum=True)) for _ in range(repeats)],
    )
    record(
        "encode, no CRC",
        [timed(lambda: wire.encode(tensor, root="tensor", checksum=False)) for _ in range(repeats)],
    )
    payload = wire.encode(tensor, root="tensor", checksum=True)
    steps: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        tmp = os.path.join(writer_dir, f".costs-{os.getpid()}-{next(counter)}.tmp")
        final = tmp.removesuffix(".tmp") + ".du"
        start = time.perf_counter()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        t1 = time.perf_counter()
        reserved = wsfiles.reserve_space(fd, payload.nbytes)
        t2 = time.perf_counter()
        payload.write_to_fd(fd)
        t3 = time.perf_counter()
        os.fsync(fd)
        t4 = time.perf_counter()
        os.close(fd)
        os.rename(tmp, final)
        t5 = time.perf_counter()
        os.unlink(final)
        steps["sender: create (O_EXCL)"].append(t1 - start)
        steps[f"sender: fallocate ({'reserved' if reserved else 'not supported: skipped'})"].append(t2 - t1)
        steps["sender: pwritev"].append(t3 - t2)
        steps["sender: fsync"].append(t4 - t3)
        steps["sender: close + rename"].append(t5 - t4)
    for name, times in steps.items():
        record(name, times)

    token = f"costs{secrets.token_hex(6)}"
    totals: dict[str, list[float]] = defaultdict(list)
    for fsync in (True, False):
        writer = ws.WorkspaceTransport(writer_dir, token, 120.0, fsync=fsync)
        reader = ws.WorkspaceTransport(reader_dir, token, 120.0)
        mode = "mmap" if reader.maps_files else "read"
        try:
            for _ in range(repeats):
                round_token = f"r{next(counter)}"
                encode = timed(lambda: wire.encode(tensor, root="tensor", checksum=True))
                publish = timed(lambda rt=round_token, w=writer: w.publish(rt, 1, payload))
                start = time.perf_counter()
                buf = reader.fetch(round_token, 1)
                fetch = time.perf_counter() - start
                start = time.perf_counter()
                view = wire.decode(buf)
                read_every_byte([view])
                decode = time.perf_counter() - start
                del view, buf
                writer.release(round_token, 1)
                totals[f"ours: publish, fsync {'on' if fsync else 'off'}"].append(publish)
                if fsync:
                    totals[f"ours: fetch ({mode}, length check, unlink)"].append(fetch)
                    totals["ours: decode, CRC verified, + read every byte"].append(decode)
                totals[
                    f"ours total, fsync {'on' if fsync else 'off'} (encode+publish+fetch+decode+read)"
                ].append(encode + publish + fetch + decode)
        finally:
            writer.close()
            reader.close()
    for use_mmap in (False, True):
        label = "torch.load(mmap=True)" if use_mmap else "torch.load"
        for _ in range(repeats):
            name = f"costs-{os.getpid()}-{next(counter)}.pth"
            save = timed(lambda name=name: torch.save(tensor, os.path.join(writer_dir, name)))
            start = time.perf_counter()
            loaded = torch.load(os.path.join(reader_dir, name), weights_only=True, mmap=use_mmap)
            os.unlink(os.path.join(reader_dir, name))
            read_every_byte([loaded])
            load = time.perf_counter() - start
            del loaded
            if not use_mmap:
                totals["torch.save"].append(save)
            totals[f"{label}, unlink, + read every byte"].append(load)
            totals[f"torch.save + {label} total"].append(save + load)
    for name, times in totals.items():
        record(name, times)
    return results


@contextlib.contextmanager
def _costs_directories(where: str, parent: str | None) -> Iterator[tuple[str, str, str]]:
    """(writer dir, reader dir, description) for ``--workspace-costs``: local disk or two sshfs mounts."""
    with tempfile.TemporaryDirectory(
        prefix="bench_gather_costs_", dir=parent or tempfile.gettempdir()
    ) as tmp:
        if where == "local":
            yield tmp, tmp, f"{filesystem_of(tmp)} ({tmp})"
            return
        sn = _load_simulate_nodes()
        reason = sn.require_simulation_support("sshfs")
        if reason is not None:
            raise RuntimeError(f"cannot mount sshfs here: {reason}")
        export = os.path.join(tmp, "export")
        os.mkdir(export)
        with (
            sn.sshfs_server(export, workdir=tmp) as endpoint,
            sn.sshfs_mount(endpoint, os.path.join(tmp, "a")) as mount_a,
            sn.sshfs_mount(endpoint, os.path.join(tmp, "b")) as mount_b,
        ):
            yield (
                mount_a,
                mount_b,
                f"two sshfs mounts of one export on {filesystem_of(export)}: write through one, read through the other",
            )


# ---------------------------------------------------------------------------------- parent


def _modelopt_names(nproc: int) -> set[str]:
    """The fixed segment names ModelOpt's helpers create for ranks ``0..nproc-1``."""
    return {f"rank_{r}" for r in range(nproc)} | {f"rank_{r}_config" for r in range(nproc)}


def clean_shm(existed: set[str], nproc: int, modelopt_ran: bool) -> list[str]:
    """Remove the segments ModelOpt's helpers left (fixed ``rank_*`` names); ``run_local`` removes ours."""
    removed = []
    for name in sorted(_modelopt_names(nproc) - existed if modelopt_ran else set()):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    return removed


def run_ranks(settings: Settings) -> dict[str, Any]:
    """Run the ranks (:func:`distribute_utils.launch.run_local`: all stopped on an error, the
    timeout or an interrupt); rank 0's report."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    existed = set(os.listdir(SHM_DIR))
    try:
        report: dict[str, Any] = run_local(rank_main, settings.nproc, settings, timeout=settings.timeout_s)[0]
    finally:
        removed = clean_shm(existed, settings.nproc, settings.modelopt)
        if removed:
            print(f"[bench_gather] removed segments left in {SHM_DIR}: {removed}", file=sys.stderr)
    report["removed_segments"] = removed
    return report


# ---------------------------------------------------------------------------------- workspace (parent)

_IN_CLOSE_WRITE = 0x8
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_Q_OVERFLOW = 0x4000
_IN_ISDIR = 0x40000000
_INOTIFY_EVENT = struct.Struct("iIII")
MULTINODE_JOB = Path(__file__).resolve().with_name("bench_multinode_job.py")
MULTINODE_WHERE = {"dir": "shared dir 2x2", "sshfs": "sshfs 2x2"}
"""Labels of the simulated-node setups (2 nodes x 2 ranks) in the case names."""


class FileEvents:
    """Records the files created and renamed in some directories, with inotify(7), in a thread.

    The kernel reports every creation in a watched directory whichever process makes it: a
    rank on a simulated node (its own mount namespace), or the sftp server behind every sshfs
    mount. Nothing is asked of the library. Directories are not watched recursively, so the
    benchmark creates the job's namespace directory (its job token is fixed through
    ``$DISTRIBUTE_UTILS_JOB_TOKEN``) and the baseline directory before the ranks start.
    """

    def __init__(self, directories: Sequence[str | os.PathLike[str]]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._dirs: dict[int, str] = {}
        try:
            for directory in directories:
                path = os.fspath(directory)
                wd = libc.inotify_add_watch(
                    self._fd, os.fsencode(path), _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE
                )
                if wd < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
                self._dirs[wd] = path
        except BaseException:
            os.close(self._fd)
            raise
        self.events: list[tuple[str, str, int]] = []  # (directory, name, mask), in kernel order
        self.overflowed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="FileEvents", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            pos = 0
            while pos < len(data):
                wd, mask, _cookie, length = _INOTIFY_EVENT.unpack_from(data, pos)
                start = pos + _INOTIFY_EVENT.size
                name = data[start : start + length].split(b"\0", 1)[0].decode(errors="replace")
                pos = start + length
                if mask & _IN_Q_OVERFLOW:
                    self.overflowed = True
                elif wd in self._dirs:
                    self.events.append((self._dirs[wd], name, mask))

    def _run(self) -> None:
        while not self._stop.is_set():
            select.select([self._fd], [], [], 0.1)
            self._drain()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._stop.set()
        self._thread.join()
        self._drain()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> FileEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def count(self, marks_dir: str, marks: dict[str, str | None]) -> dict[str, dict[str, int]]:
        """Per ``case|key``: files created, renamed into place and closed after writing.

        Events between a method's start marker and the next marker belong to that method.
        """
        counts: dict[str, dict[str, int]] = {}
        current: str | None = None
        for directory, name, mask in self.events:
            if directory == marks_dir and name.startswith(WS_MARK_PREFIX):
                if mask & _IN_CREATE:
                    current = marks.get(name)
                continue
            if current is None or mask & _IN_ISDIR:
                continue
            entry = counts.setdefault(
                current, {"created": 0, "renamed_into_place": 0, "closed_after_write": 0}
            )
            if mask & _IN_CREATE:
                entry["created"] += 1
            if mask & _IN_MOVED_TO:
                entry["renamed_into_place"] += 1
            if mask & _IN_CLOSE_WRITE:
                entry["closed_after_write"] += 1
        return counts


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """The filesystem type holding ``path`` (the library's own mountinfo reader)."""
    from distribute_utils.transports.files import filesystem_type

    return filesystem_type(path)


def _watched_workspace(backing: Path, token: str) -> tuple[Path, Path]:
    """Create the job's namespace directory and the baseline directory ahead of the ranks."""
    from distribute_utils.transports.namespace import namespace_path

    namespace = Path(namespace_path(backing, token))
    namespace.mkdir(mode=0o700)
    baseline = backing / WS_BASELINE_DIR
    baseline.mkdir()
    return namespace, baseline


def _workspace_leftovers(backing: Path) -> list[str]:
    """What the ranks left in the workspace, except the workspace lock file (kept by design)."""
    return sorted(
        str(p.relative_to(backing)) for p in backing.rglob("*") if not p.name.startswith(".du-sweep-")
    )


@contextlib.contextmanager
def local_workspace(settings: Settings) -> Iterator[tuple[Settings, dict[str, Any]]]:
    """A fresh workspace on local disk for the local ranks; counts files; removed afterwards."""
    from distribute_utils.transports.namespace import JOB_TOKEN_ENV

    info: dict[str, Any] = {}
    if "workspace" not in settings.groups:
        yield settings, info
        return
    parent = settings.workspace_dir or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="bench_gather_ws_", dir=parent) as tmp:
        backing = Path(tmp)
        info.update(path=str(backing), filesystem=filesystem_of(backing))
        token = f"bench{secrets.token_hex(8)}"
        _namespace, baseline = _watched_workspace(backing, token)
        previous = os.environ.get(JOB_TOKEN_ENV)
        os.environ[JOB_TOKEN_ENV] = token  # inherited by the spawned ranks: a known namespace
        try:
            with FileEvents([_namespace, baseline]) as events:
                yield dataclasses.replace(settings, workspace_dir=str(backing)), info
        finally:
            if previous is None:
                os.environ.pop(JOB_TOKEN_ENV, None)
            else:
                os.environ[JOB_TOKEN_ENV] = previous
        info["events"] = events
        info["baseline_dir"] = str(baseline)
        info["overflowed"] = events.overflowed
        info["leftovers"] = _workspace_leftovers(backing)


def _load_simulate_nodes() -> Any:
    import importlib.util

    if "simulate_nodes" in sys.modules:
        return sys.modules["simulate_nodes"]
    spec = importlib.util.spec_from_file_location(
        "simulate_nodes", Path(__file__).resolve().with_name("simulate_nodes.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_nodes"] = module
    spec.loader.exec_module(module)
    return module


def run_multinode(settings: Settings, mode: str) -> dict[str, Any]:
    """Case 5 on 2 simulated nodes x 2 ranks over workspace ``mode`` (``dir`` or ``sshfs``).

    Runs ``scripts/bench_multinode_job.py`` under ``simulate_nodes.run_simulated``; the
    workspace's backing directory is a temporary one on the host, watched with inotify.
    Returns rank 0's report plus the file counts, or ``{"skipped": why}``.
    """
    from distribute_utils.transports.namespace import JOB_TOKEN_ENV

    sn = _load_simulate_nodes()
    reason = sn.require_simulation_support(mode)
    if reason is not None:
        return {"mode": mode, "skipped": reason}
    where = MULTINODE_WHERE[mode]
    job_settings = dataclasses.replace(
        settings, nproc=4, groups=("workspace",), workspace_dir=None, multinode=()
    )
    token = f"bench{secrets.token_hex(8)}"
    outcome: dict[str, Any] = {"mode": mode, "where": where, "load_average_before": os.getloadavg()}
    parent = settings.workspace_dir or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="bench_gather_nodes_", dir=parent) as tmp:
        backing, results = Path(tmp) / "backing", Path(tmp) / "results"
        backing.mkdir()
        results.mkdir()
        outcome["backing_filesystem"] = filesystem_of(backing)
        namespace, baseline = _watched_workspace(backing, token)
        env = {
            "DU_RESULTS": str(results),
            "DU_BENCH_SETTINGS": json.dumps(dataclasses.asdict(job_settings)),
            "DU_BENCH_WHERE": where,
            JOB_TOKEN_ENV: token,
        }
        with FileEvents([namespace, baseline]) as events:
            result = sn.run_simulated(
                MULTINODE_JOB,
                [],
                nodes=2,
                nproc_per_node=2,
                workspace=mode,
                shm_size="1g",
                timeout=settings.timeout_s,
                backing_dir=backing,
                env=env,
            )
        outcome["load_average_after"] = os.getloadavg()
        outcome["duration_s"] = result.duration
        outcome["mounts_left"] = sn.find_mounts_anywhere(str(result.run_dir))
        outcome["processes_left"] = [pid for pid in result.pids if sn._pid_alive(pid)]
        outcome["leftovers"] = _workspace_leftovers(backing)
        if result.returncode != 0 or not (results / "rank0.json").exists():
            outcome["error"] = f"exit code {result.returncode}:\n{result.format_outputs()[-4000:]}"
            return outcome
        job = json.loads((results / "rank0.json").read_text())
        outcome.update(job)
        outcome["workspace_files"] = events.count(str(baseline), job["report"].get("workspace_marks", {}))
        outcome["inotify_overflowed"] = events.overflowed
    return outcome


def add_workspace_columns(rows: list[dict[str, Any]], io: dict[str, Any], files: dict[str, Any]) -> None:
    """Files created and bytes written in the workspace per round, on the workspace rows."""
    for row in rows:
        label = f"{row['case']}|{row['key']}"
        if label not in io:
            continue
        rounds = io[label]["rounds"]
        per_rank = io[label]["per_rank"]
        row["rounds_counted"] = rounds
        row["written_bytes_per_round"] = sum(d["write_bytes"] for d in per_rank) / rounds
        row["write_bytes_per_rank"] = [d["write_bytes"] for d in per_rank]
        counted = files.get(label)
        row["files_per_round"] = counted["created"] / rounds if counted is not None else 0.0
        row["file_events"] = counted


def format_workspace(report: dict[str, Any]) -> list[str]:
    """The workspace table (with files and bytes) and the hierarchical-vs-flat summary."""
    rows = [row for row in report["rows"] if row["case"].startswith("workspace")]
    if not rows and not report.get("multinode"):
        return []
    lines = [
        "",
        "workspace: ours vs torch.save + torch.load through the same directory "
        "(vs ours = its median / ours = ours' speed / its speed)",
    ]
    header = (
        f"{'case':<48} {'method':<50} {'median ms':>10} {'vs ours':>8} {'files/round':>11} "
        f"{'MiB written/round':>17} {'n':>3}"
    )
    lines += [header, "-" * len(header)]
    for row in rows:
        ratio = f"{row['ratio_vs_ours']:.2f}x" if row.get("ratio_vs_ours") is not None else "-"
        files = f"{row['files_per_round']:.2f}" if "files_per_round" in row else "-"
        written = f"{row['written_bytes_per_round'] / MIB:.2f}" if "written_bytes_per_round" in row else "-"
        lines.append(
            f"{row['case']:<48} {row['method']:<50} {row['median_ms']:>10.2f} {ratio:>8} {files:>11} "
            f"{written:>17} {row['n']:>3}"
        )
    by = {(row["case"], row["key"]): row for row in rows}
    summary = []
    for row in rows:
        hier = by.get((row["case"], "ours_auto"))
        if row["key"] != "ours" or hier is None:
            continue
        summary.append(
            f"  {row['case']}: flat {row['median_ms']:.2f} ms, hierarchical {hier['median_ms']:.2f} ms "
            f"(flat / hierarchical {row['median_ms'] / hier['median_ms']:.2f}x); files/round "
            f"{row.get('files_per_round', 0):.2f} -> {hier.get('files_per_round', 0):.2f}; MiB written/round "
            f"{row.get('written_bytes_per_round', 0) / MIB:.2f} -> {hier.get('written_bytes_per_round', 0) / MIB:.2f}"
        )
    if summary:
        lines += [
            "",
            "hierarchical (transport='auto': one bundle per remote host) vs flat (transport='workspace'):",
        ]
        lines += summary
    verified = dict(report.get("workspace_verified", {}))
    for run in report.get("multinode", []):
        verified.update(run.get("report", {}).get("workspace_verified", {}))
    wrong = {label: v for label, v in verified.items() if v is not True}
    lines.append(
        f"  results checked bit for bit on rank 0 (first warm-up of every method): "
        f"{'all exact' if not wrong else f'WRONG: {wrong}'} ({len(verified)} methods)"
    )
    for run in report.get("multinode", []):
        state = run.get("skipped") or ("FAILED" if "error" in run else "ran")
        lines.append(
            f"  simulated nodes over {run['mode']}: {state}; load average before {_loads(run.get('load_average_before'))}, "
            f"after {_loads(run.get('load_average_after'))}; {run.get('duration_s', 0):.0f} s; leftovers "
            f"{run.get('leftovers', [])}; mounts left {run.get('mounts_left', [])}"
        )
        if "error" in run:
            lines.append(run["error"])
    return lines


def _loads(values: Sequence[float] | None) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "-"


def _ratio_rows(rows: list[dict[str, Any]]) -> None:
    by_key = {(row["case"], row["key"]): row for row in rows}
    for row in rows:
        base = by_key.get((row["case"], row["compare_to"])) if row["compare_to"] else None
        ok = base and row["median_ms"] is not None and base["median_ms"]
        row["ratio_vs_ours"] = row["median_ms"] / base["median_ms"] if ok else None


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """PASS / FAIL / SKIP per target, with the measured value.

    The layer-config target is judged on every layer case where ModelOpt ran, against ours on
    the same ``DecoderLayerConfig`` objects; where ModelOpt's helper failed it is a SKIP (the
    table says why).
    """
    rows = report["rows"]
    memory = {entry["key"]: entry for entry in report.get("memory", [])}
    targets: list[dict[str, Any]] = []

    def find(prefix: str, key: str) -> list[dict[str, Any]]:
        return [row for row in rows if row["case"].startswith(prefix) and row["key"] == key]

    def add(name: str, value: float | None, threshold: float, higher_is_better: bool, unit: str) -> None:
        if value is None:
            status = "SKIP"
        else:
            status = "PASS" if (value >= threshold if higher_is_better else value <= threshold) else "FAIL"
        op = ">=" if higher_is_better else "<="
        targets.append(
            {"target": f"{name} {op} {threshold:g}{unit}", "value": value, "unit": unit, "status": status}
        )

    t = TARGETS
    local_cases = sorted({row["case"] for row in rows if row["case"].startswith("workspace, local disk")})
    if local_cases:
        for case in local_cases:
            for key in ("save_load", "save_load_mmap"):
                found = [row for row in rows if row["case"] == case and row["key"] == key]
                short = case.removeprefix("workspace, ").removesuffix(", per layer")
                add(
                    f"{short}: ours speed / {WS_METHODS[key]}",
                    found[0]["ratio_vs_ours"] if found else None,
                    t["workspace_vs_save_load"],
                    True,
                    "x",
                )
    if not any(not row["case"].startswith("workspace") for row in rows):
        return targets
    for key, name, threshold in (
        ("modelopt", "ModelOpt get_tensors_parallel", t["bulk_vs_modelopt"]),
        ("gather", "dist.gather", t["bulk_vs_dist_gather"]),
    ):
        found = find("bulk", key)
        add(
            f"bulk: ours faster than {name} by",
            found[0]["ratio_vs_ours"] if found else None,
            threshold,
            True,
            "x",
        )
    layer_rows = find("layer", "modelopt") or [{"case": "layer config", "ratio_vs_ours": None}]
    for row in layer_rows:
        name = f"{row['case'].removesuffix(', per layer')}: ours faster than ModelOpt by"
        add(name, row["ratio_vs_ours"], t["layer_vs_modelopt"], True, "x")
    small = find("small", "ours")
    add(
        "small round trip: ours median",
        small[0]["median_ms"] if small else None,
        t["small_max_ms"],
        False,
        " ms",
    )
    mem = memory.get("ours")
    add(
        "memory: rank 0 peak growth / bytes received",
        mem["ratio"] if mem else None,
        t["memory_max_ratio"],
        False,
        "x",
    )
    return targets


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables."""
    lines = []
    shm_rows = [row for row in report["rows"] if not row["case"].startswith("workspace")]
    header = f"{'case':<36} {'method':<50} {'median ms':>10} {'vs ours':>8} {'n':>4}"
    if shm_rows:
        lines += [header, "-" * len(header)]
    for row in shm_rows:
        ratio = f"{row['ratio_vs_ours']:.2f}x" if row["ratio_vs_ours"] is not None else "-"
        if row["median_ms"] is None:
            lines.append(f"{row['case']:<36} {row['method']:<50} {row['note']}")
            continue
        lines.append(
            f"{row['case']:<36} {row['method']:<50} {row['median_ms']:>10.3f} {ratio:>8} {row['n']:>4}"
        )
    if report.get("memory"):
        received = report["memory"][0]["received_bytes"] / MIB
        lines += ["", f"memory: rank 0 during one bulk gather, receiving {received:.0f} MiB"]
        header = (
            f"{'method':<50} {'peak growth MiB':>16} {'/ received':>11} {'anon MiB':>9} {'shmem MiB':>10}"
        )
        lines += [header, "-" * len(header)]
        for entry in report["memory"]:
            lines.append(
                f"{entry['method']:<50} {entry['peak_growth_bytes'] / MIB:>16.1f} {entry['ratio']:>10.2f}x "
                f"{entry['held_anon_bytes'] / MIB:>9.1f} {entry['held_shmem_bytes'] / MIB:>10.1f}"
            )
    lines += format_workspace(report)
    lines += ["", "targets:"]
    for target in report["targets"]:
        value = f"{target['value']:.2f}{target['unit']}" if target["value"] is not None else "n/a"
        lines.append(f"  {target['status']:<5} {target['target']:<62} measured {value}")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    try:
        from importlib.metadata import version

        modelopt_version: str | None = version("nvidia-modelopt")
    except Exception:
        modelopt_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "distribute_utils": distribute_utils.__version__,
        "modelopt": modelopt_version,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "shm_free_bytes": os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize,
    }


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (default 4)")
    parser.add_argument("--repeats", type=int, help="timed repetitions per method (default 7, quick 3)")
    parser.add_argument("--json", type=Path, help="write every measurement to this file")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats, no ModelOpt: < 60 s")
    parser.add_argument("--bulk-mib", type=int, help="MiB per rank in the bulk case (default 64, quick 8)")
    parser.add_argument("--layers", type=int, help="layers in a row in the layer case (default 32, quick 8)")
    parser.add_argument("--rounds", type=int, help="rounds of the small round trip (default 200, quick 50)")
    parser.add_argument(
        "--modelopt",
        action=argparse.BooleanOptionalAction,
        help="compare with ModelOpt's helpers when importable (default: on, off with --quick)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    parser.add_argument(
        "--workspace-case",
        action="store_true",
        help="only the workspace cases: local disk, then 2 simulated nodes over a shared dir and sshfs",
    )
    parser.add_argument(
        "--workspace",
        action=argparse.BooleanOptionalAction,
        help="include the workspace cases in a full run (default: on, off with --quick)",
    )
    parser.add_argument(
        "--workspace-dir",
        help="local-disk directory in which the workspace cases make their temporary workspaces "
        "(default: the system's temporary directory; must not be a tmpfs)",
    )
    parser.add_argument(
        "--multinode",
        default="dir,sshfs",
        help="simulated-node workspaces of the workspace cases, comma-separated: dir, sshfs, or none "
        "(default dir,sshfs; needs root)",
    )
    parser.add_argument(
        "--workspace-costs",
        choices=("local", "sshfs"),
        help="only measure, in this process alone, each step of moving one bulk payload through a "
        "workspace directory (ours vs torch.save/torch.load): on local disk, or across two sshfs mounts",
    )
    parser.add_argument("--ws-repeats", type=int, help="timed repetitions per workspace method (default 5)")
    parser.add_argument(
        "--ws-layers", type=int, help="layers in a row in the workspace layer case (default 16)"
    )
    parser.add_argument(
        "--write-costs",
        action="store_true",
        help="only measure, in this process alone, the steps of moving one bulk payload through /dev/shm",
    )
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error("--nproc must be at least 2 (rank 0 receives from the others)")
    quick = args.quick
    multinode = tuple(m for m in args.multinode.split(",") if m and m != "none")
    unknown = sorted(set(multinode) - set(MULTINODE_WHERE))
    if unknown:
        parser.error(f"--multinode: unknown workspace(s) {unknown}; valid: dir, sshfs, none")
    if args.workspace_case:
        groups: tuple[str, ...] = ("workspace",)
    elif args.workspace if args.workspace is not None else not quick:
        groups = ("shm", "workspace")
    else:
        groups = ("shm",)
    only_workspace = groups == ("workspace",)
    settings = Settings(
        nproc=args.nproc,
        repeats=args.repeats or (3 if quick else 7),
        warmup=1,
        bulk_bytes=(args.bulk_mib or (8 if quick else 64)) * MIB,
        layers=args.layers or (8 if quick else 32),
        small_rounds=args.rounds or (50 if quick else 200),
        modelopt=args.modelopt if args.modelopt is not None else not (quick or only_workspace),
        quick=quick,
        timeout_s=args.timeout,
        groups=groups,
        workspace_dir=os.path.abspath(args.workspace_dir) if args.workspace_dir else None,
        workspace_layers=args.ws_layers or (4 if quick else 16),
        workspace_repeats=args.ws_repeats or (3 if quick else 5),
        multinode=multinode if "workspace" in groups else (),
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> int:
    settings, args = parse_args(argv)
    command = " ".join(["python", "scripts/bench_gather.py", *(sys.argv[1:] if argv is None else argv)])
    if args.write_costs:
        torch.set_num_threads(1)
        costs = write_costs(settings.bulk_bytes, max(settings.repeats, 5))
        print(f"$ {command}")
        print(format_write_costs(costs, settings.bulk_bytes))
        if args.json:
            document = {"command": command, "environment": environment(), "write_costs": costs}
            args.json.write_text(json.dumps(document, indent=2) + "\n")
        return 0
    if args.workspace_costs:
        torch.set_num_threads(1)
        with _costs_directories(args.workspace_costs, settings.workspace_dir) as (writer, reader, what):
            load_before = os.getloadavg()
            costs = workspace_costs(writer, reader, settings.bulk_bytes, max(settings.repeats, 5))
        print(f"$ {command}")
        print(format_write_costs(costs, settings.bulk_bytes, f"through a workspace: {what}"))
        print(
            f"load average before {_loads(load_before)}, after {_loads(os.getloadavg())} on {os.cpu_count()} CPUs"
        )
        if args.json:
            document = {"command": command, "environment": environment(), "workspace_costs": costs}
            args.json.write_text(json.dumps(document, indent=2) + "\n")
        return 0
    notes = []
    if settings.modelopt:
        clash = sorted(_modelopt_names(settings.nproc) & set(os.listdir(SHM_DIR)))
        if clash:
            notes.append(
                f"ModelOpt skipped: its fixed segment names {clash} already exist in {SHM_DIR} "
                "(another job, or a crashed run); it would fail with FileExistsError"
            )
            settings = dataclasses.replace(settings, modelopt=False)
    env = environment()
    started = time.perf_counter()
    with local_workspace(settings) as (ranks_settings, local_ws):
        if "workspace" in settings.groups and local_ws["filesystem"] in ("tmpfs", "ramfs"):
            notes.append(
                f"the local workspace {local_ws['path']} is on {local_ws['filesystem']}, not a disk: "
                "pass --workspace-dir on a disk-backed filesystem"
            )
        report = run_ranks(ranks_settings)
    if local_ws:
        report["local_workspace"] = {k: v for k, v in local_ws.items() if k != "events"}
        files = local_ws["events"].count(local_ws["baseline_dir"], report.get("workspace_marks", {}))
        add_workspace_columns(report["rows"], report.get("workspace_io", {}), files)
    if settings.multinode:
        report["multinode"] = []
        for mode in settings.multinode:
            print(f"[bench_gather] workspace on 2 simulated nodes over {mode} ...", flush=True)
            run = run_multinode(settings, mode)
            if "rows" in run:
                rows = run.pop("rows")
                add_workspace_columns(rows, run["report"].get("workspace_io", {}), run["workspace_files"])
                report["rows"] += rows
            report["multinode"].append(run)
            print(f"[bench_gather] {mode}: {run.get('skipped') or ('failed' if 'error' in run else 'done')}")
    report["command"] = command
    report["settings"] = dataclasses.asdict(settings)
    report["environment"] = env
    report["environment"]["load_average_at_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    if "shm" not in settings.groups:
        pass
    elif not settings.modelopt:
        notes.append("ModelOpt not compared (--quick or --no-modelopt; pass --modelopt to include it)")
    elif "modelopt_skipped" in report:
        notes.append(f"ModelOpt not importable, skipped: {report['modelopt_skipped']}")
    if settings.quick:
        notes.append("--quick: small sizes; the targets are defined for the full run")
    notes.append(
        f"load average at start {_loads(env['load_average_at_start'])}, at end "
        f"{_loads(env['load_average_at_end'])} (1/5/15 min) on {env['cpus']} CPUs"
    )
    if "workspace" in settings.groups:
        ws = report.get("local_workspace", {})
        notes.append(
            f"workspace cases: local workspace on {ws.get('filesystem')} ({ws.get('path')}), leftovers "
            f"{ws.get('leftovers')}; files/round = files created in the workspace per round (inotify), "
            "MiB written/round = sum over ranks of /proc/<pid>/io write_bytes per round"
        )
    report["notes"] = notes
    _ratio_rows(report["rows"])
    report["targets"] = evaluate_targets(report)
    print(f"$ {command}")
    print(format_report(report))
    print(f"wall time {report['wall_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
