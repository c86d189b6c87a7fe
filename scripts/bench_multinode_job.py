#!/usr/bin/env python3
"""torchrun job of ``scripts/bench_gather.py``: the workspace cases on simulated nodes.

Run by ``bench_gather.py`` (``--workspace-case``, or a full run) through
``scripts/simulate_nodes.py`` on 2 simulated hosts x 2 ranks; it can also be started by hand::

    DU_RESULTS=/tmp/res python scripts/simulate_nodes.py --nodes 2 --nproc-per-node 2 \\
        --workspace sshfs -- scripts/bench_multinode_job.py

Every rank gathers to rank 0, through the shared workspace ``$DU_WORKSPACE``, with the methods
of ``bench_gather.bench_workspace``: ours flat (``transport="workspace"``: one file per sender),
ours hierarchical (``transport="auto"``: shared memory within a host, one bundle file per
remote host), and ``torch.save`` by every sender + ``torch.load`` (plain and ``mmap=True``) by
rank 0 through the same directory. Rank 0 reads every byte it receives (a lazily mapped file
on a network filesystem would otherwise never cross the network).

Environment:
    DU_WORKSPACE: the shared directory (set by simulate_nodes).
    DU_RESULTS: directory where rank 0 writes ``rank0.json`` (rows, I/O counters, markers);
        without it, rank 0 prints the table only.
    DU_BENCH_SETTINGS: ``bench_gather.Settings`` as JSON (default: 64 MiB, 5 repeats, 16 layers).
    DU_BENCH_WHERE: label of the setup in the case names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gather as bg

from distribute_utils.transports.namespace import close_namespaces

METHODS = ("ours", "ours_auto", "save_load", "save_load_mmap")


def settings_from_env() -> bg.Settings:
    """The settings the parent passed, or defaults for a run by hand."""
    raw = os.environ.get("DU_BENCH_SETTINGS")
    if raw:
        fields = json.loads(raw)
        for name in ("groups", "multinode"):
            fields[name] = tuple(fields.get(name, ()))
        return bg.Settings(**fields)
    return bg.Settings(
        nproc=int(os.environ.get("WORLD_SIZE", "4")),
        repeats=5,
        warmup=1,
        bulk_bytes=64 * bg.MIB,
        layers=16,
        small_rounds=0,
        modelopt=False,
        breakdown=False,
        quick=False,
        timeout_s=1800.0,
        groups=("workspace",),
    )


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    settings = dataclasses.replace(settings_from_env(), nproc=world)
    where = os.environ.get("DU_BENCH_WHERE", f"{os.environ.get('DU_SIM_NODES', '?')} nodes, {world} ranks")
    setup = bg.WorkspaceSetup(where, os.environ["DU_WORKSPACE"], METHODS, read_every_byte=True)
    ctx = bg.RankContext(rank, world, settings)
    started = time.perf_counter()
    try:
        bg.bench_workspace(ctx, setup)
        dist.barrier()
        close_namespaces()  # leave the job's namespace (the last rank out removes it)
        dist.barrier()
        if rank == 0:
            rows = [row.to_json() for row in ctx.rows]
            print(f"[bench_multinode_job] done in {time.perf_counter() - started:.1f} s", flush=True)
            results = os.environ.get("DU_RESULTS")
            if results:
                document = {"rows": rows, "report": ctx.report, "load_average": os.getloadavg()}
                Path(results, "rank0.json").write_text(json.dumps(document))
            else:
                bg.ratio_rows(rows)
                print("\n".join(bg.format_workspace({"rows": rows})))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
