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
import dataclasses
import functools
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gatherbench.common import (
    LAYER_TENSORS,
    MIB,
    SHM_DIR,
    TARGETS,
    RankContext,
    Settings,
    import_modelopt,
    loads_text,
)
from gatherbench.shm_cases import (
    bench_bulk,
    bench_layers,
    bench_memory,
    bench_small,
    format_write_costs,
    write_costs,
)
from gatherbench.workspace_cases import (
    MULTINODE_WHERE,
    WS_METHODS,
    WorkspaceSetup,
    add_workspace_columns,
    bench_workspace,
    costs_directories,
    format_workspace,
    local_workspace,
    run_multinode,
    workspace_costs,
)

import distribute_utils
from distribute_utils.launch import run_local

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
            steps.insert(2, ("layer config (ModelOpt-sized)", functools.partial(bench_layers, n_tensors=32)))
    if "workspace" in settings.groups and settings.workspace_dir is not None:
        local = WorkspaceSetup(
            f"local disk 1x{settings.nproc}",
            settings.workspace_dir,
            ("ours", "save_load", "save_load_mmap"),
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


def ratio_rows(rows: list[dict[str, Any]]) -> None:
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
        with costs_directories(args.workspace_costs, settings.workspace_dir) as (writer, reader, what):
            load_before = os.getloadavg()
            costs = workspace_costs(writer, reader, settings.bulk_bytes, max(settings.repeats, 5))
        print(f"$ {command}")
        print(format_write_costs(costs, settings.bulk_bytes, f"through a workspace: {what}"))
        print(
            f"load average before {loads_text(load_before)}, after {loads_text(os.getloadavg())} on {os.cpu_count()} CPUs"
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
        f"load average at start {loads_text(env['load_average_at_start'])}, at end "
        f"{loads_text(env['load_average_at_end'])} (1/5/15 min) on {env['cpus']} CPUs"
    )
    if "workspace" in settings.groups:
        ws = report.get("local_workspace", {})
        notes.append(
            f"workspace cases: local workspace on {ws.get('filesystem')} ({ws.get('path')}), leftovers "
            f"{ws.get('leftovers')}; files/round = files created in the workspace per round (inotify), "
            "MiB written/round = sum over ranks of /proc/<pid>/io write_bytes per round"
        )
    report["notes"] = notes
    ratio_rows(report["rows"])
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
