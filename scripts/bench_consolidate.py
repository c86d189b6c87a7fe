#!/usr/bin/env python3
"""Benchmark ``distribute-utils consolidate`` against a naive single-process consolidation.

One run:

1. writes a synthetic GPT-like checkpoint of about ``--size-gb`` GiB (bfloat16, 8 layers), sharded
   ``--tp`` x ``--pp`` in the own layout (safetensors), into a fresh temporary directory under
   ``--tmpdir`` (default ``/tmp``), and ``sync``s it to disk;
2. **baseline** (a child process): ``safetensors.torch.load_file`` of every shard (into memory), the same
   merge rules (``torch.cat`` for concat rules, via ``MergeRule.merge``), layers renamed to global names,
   then ``safetensors.torch.save_file`` of the whole model into one file and ``os.fsync`` of it (our
   writer fsyncs too, so both outputs are durable when the clock stops);
3. **ours** (a child process): ``python -m distribute_utils consolidate IN OUT --quiet --json``, which spawns
   ``tp * pp`` local ranks; rank 0 writes the one output file;
4. **ours, one process** (a child process): the same command with ``--nproc 1`` (every shard read in one
   process, streamed to the same writer), to separate the cost of starting ranks from the rest;
5. checks that all outputs hold the same tensors, bit for bit (names, dtypes, shapes, bytes).

Wall time is measured around each child process, so all include the interpreter start and ``import
torch``; ours also includes spawning its ranks and their exit. "in-process" is the time the work itself took
inside the process (for ours: on rank 0, from entering ``consolidate_checkpoint`` to the published output).
Peak memory is the ``VmHWM`` of the baseline process and of ours's rank 0 process (each reads its own
``/proc/self/status`` at the end). The load average is recorded: other work on the machine slows process
start-up most. A ``sync`` runs before each
measured step so that one step's disk writeback does not slow the next. The temporary directory (several
GiB) is removed at the end unless ``--keep``.

Usage::

    python scripts/bench_consolidate.py                    # ~2 GiB, TP 2 x PP 2 (about a minute here)
    python scripts/bench_consolidate.py --size-gb 0.25     # quick
    python scripts/bench_consolidate.py --json result.json # also write the numbers as JSON ('-': stdout)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_TIME_RATIO = 1.3
TARGET_RSS_RATIO = 0.5


def _vmhwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def baseline_worker(input_dir: str, output_dir: str) -> dict[str, Any]:
    """The naive consolidation, in this process: load everything, merge, save one file, fsync."""
    start = time.perf_counter()
    from safetensors.torch import load_file, save_file

    from distribute_utils.consolidate import plan_checkpoint

    layout, plan = plan_checkpoint(input_dir)  # names and rules from metadata (no tensor data)
    shards = {(t, p): load_file(layout.file_for(t, p)) for t, p in layout.shards()}
    merged = {}
    for e in plan:
        parts = [shards[(t, e.pp_rank)][e.local_name] for t in range(layout.tp)]
        merged[e.name] = e.rule.merge(e.name, parts) if len(parts) > 1 else parts[0]
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "model.safetensors")
    save_file(merged, path, metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"seconds": time.perf_counter() - start, "peak_rss_bytes": _vmhwm(), "tensors": len(merged)}


def _make_input(root: Path, size_gb: float, tp: int, pp: int) -> dict[str, Any]:
    from distribute_utils.consolidate import (
        make_gpt_state_dict,
        shard_state_dict,
        synthetic_size_for,
        write_own_layout,
    )

    dims = synthetic_size_for(int(size_gb * 2**30), num_layers=8)
    sd = make_gpt_state_dict(**dims.as_kwargs())  # type: ignore[arg-type]
    write_own_layout(root, shard_state_dict(sd, tp, pp))
    info = {
        "hidden": dims.hidden,
        "layers": dims.num_layers,
        "tensors": len(sd),
        "bytes": dims.nbytes,
    }
    del sd
    gc.collect()
    return info


def _run(cmd: list[str]) -> tuple[float, dict[str, Any]]:
    os.sync()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout)


def _compare(a: Path, b: Path) -> int:
    """Number of tensors, after checking that both files hold the same ones bit for bit."""
    import torch

    from distribute_utils.consolidate import load_safetensors

    x, y = load_safetensors(a), load_safetensors(b)
    if set(x) != set(y):
        raise SystemExit(f"outputs differ in names: {sorted(set(x) ^ set(y))[:5]}")
    for name, t in x.items():
        u = y[name]
        if t.dtype != u.dtype or t.shape != u.shape:
            raise SystemExit(
                f"tensor '{name}' differs: {t.dtype} {tuple(t.shape)} vs {u.dtype} {tuple(u.shape)}"
            )
        if not torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)):
            raise SystemExit(f"tensor '{name}' differs in its bytes")
    return len(x)


def _table(r: dict[str, Any]) -> str:
    gib = r["model"]["bytes"] / 2**30
    rows = [
        ("baseline: 1 process, load_file + torch.cat + save_file + fsync", r["baseline"]),
        (f"ours: `distribute-utils consolidate`, {r['nproc']} local ranks (rank 0)", r["ours"]),
        ("ours, one process: `consolidate --nproc 1`", r["ours_one_process"]),
    ]
    load = r["load_average"]
    lines = [
        f"model: {r['model']['tensors']} tensors, {gib:.2f} GiB bfloat16, TP {r['tp']} x PP {r['pp']}, "
        f"own layout (safetensors), under {r['tmpdir']}; "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after",
        "",
        "| method | wall s | in-process s | start + exit s | GB/s (wall) | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, m in rows:
        lines.append(
            f"| {label} | {m['wall_s']:.2f} | {m['seconds']:.2f} | {m['wall_s'] - m['seconds']:.2f} | "
            f"{r['model']['bytes'] / m['wall_s'] / 1e9:.2f} | {m['peak_rss_bytes'] / 2**20:.0f} |"
        )
    t, m = r["time_ratio"], r["rss_ratio"]
    lines += [
        "",
        f"time ours / baseline: {t:.2f}x "
        f"(target <= {TARGET_TIME_RATIO}x: {'PASS' if t <= TARGET_TIME_RATIO else 'FAIL'})",
        f"peak RSS ours (rank 0) / baseline: {m:.2f} (target <= {TARGET_RSS_RATIO}: "
        f"{'PASS' if m <= TARGET_RSS_RATIO else 'FAIL'})",
        f"outputs identical (all three): {r['identical_tensors']} tensors, bit for bit",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="model size in GiB (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    parser.add_argument("--tmpdir", default="/tmp", help="where the temporary directory goes (default /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the results as JSON ('-': stdout)",
    )
    parser.add_argument("--baseline-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_worker:
        print(json.dumps(baseline_worker(*args.baseline_worker)))
        return 0

    root = Path(tempfile.mkdtemp(prefix="du_bench_consolidate_", dir=args.tmpdir))
    try:
        inp, base_out, ours_out = root / "in", root / "baseline", root / "ours"
        t = time.perf_counter()
        model = _make_input(inp, args.size_gb, args.tp, args.pp)
        print(f"wrote the input in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        load_before = os.getloadavg()[0]
        wall_b, base = _run([sys.executable, __file__, "--baseline-worker", str(inp), str(base_out)])
        cli = [sys.executable, "-m", "distribute_utils", "consolidate", str(inp)]
        wall_o, ours = _run([*cli, str(ours_out), "--quiet", "--json"])
        wall_1, one = _run([*cli, str(root / "one"), "--quiet", "--json", "--nproc", "1"])
        load_after = os.getloadavg()[0]
        identical = _compare(base_out / "model.safetensors", ours_out / "model.safetensors")
        if _compare(ours_out / "model.safetensors", root / "one" / "model.safetensors") != identical:
            raise SystemExit("the one-process output has a different number of tensors")
        result = {
            "model": model,
            "tp": args.tp,
            "pp": args.pp,
            "nproc": ours["world_size"],
            "tmpdir": args.tmpdir,
            "baseline": {"wall_s": wall_b, **base},
            "ours": {
                "wall_s": wall_o,
                "seconds": ours["seconds"],
                "peak_rss_bytes": ours["peak_rss_bytes"],
                "transport": ours["transport"],
                "rounds": ours["rounds"],
            },
            "ours_one_process": {
                "wall_s": wall_1,
                "seconds": one["seconds"],
                "peak_rss_bytes": one["peak_rss_bytes"],
            },
            "load_average": [load_before, load_after],
            "time_ratio": wall_o / wall_b,
            "rss_ratio": ours["peak_rss_bytes"] / base["peak_rss_bytes"],
            "identical_tensors": identical,
        }
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}", file=sys.stderr)
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
