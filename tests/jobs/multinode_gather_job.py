"""torchrun job for simulated nodes: many gather rounds across hosts, checked bit for bit.

Every rank writes a JSON report to ``$DU_RESULTS/rank<r>.json``: wrong results seen (on
receivers), the routes the gathers took, and any segment of ours left in its /dev/shm.
Arguments: ``--rounds N --mode auto|collective|workspace``; ``--mode matrix [--every K]`` runs the
two-host combinations of tests/test_route_matrix.py instead (every K-th of them) and reports each
rank's results for that module to check.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from distribute_utils import get_configs_parallel, get_tensors_parallel
from distribute_utils.transports.shm import pooled_bytes, release_shared_memory

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn, torch.bool]


def sample(rank: int, round_: int) -> torch.Tensor:
    """Deterministic tensor whose size and dtype vary with the rank and the round."""
    dtype = DTYPES[(rank + round_) % len(DTYPES)]
    n = (rank + 1) * ((round_ * 7919) % 5000) + round_
    gen = torch.Generator().manual_seed(round_ * 100 + rank)
    raw = torch.randint(
        0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen
    )
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype)


class Routes(logging.Handler):
    """Collects the route each gather took (logged by distribute_utils.roles at debug level)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("round "):
            route = message.split(": ", 1)[1].split(" over ", 1)[1]
            self.seen[route] = self.seen.get(route, 0) + 1


def short_bundle(workspace: str | None) -> list[str]:
    """A gather of all four ranks whose remote host's bundle (rank 2's, for ranks 2 and 3) reaches rank 0
    short of rank 3's part (replaced at the carriers' "fetched" point, as a leader running other code
    would send it); then the same gather again. What each of the two said on this rank."""
    from distribute_utils import wire
    from distribute_utils.transports import carriers

    rank = dist.get_rank()

    def shorten(point: str, sender: int, carrier: object, buffer: object) -> object:
        if point != "fetched" or sender != 2:
            return None
        raw = buffer.numpy().tobytes() if isinstance(buffer, torch.Tensor) else bytes(memoryview(buffer))
        bundle = wire.decode(raw)
        short = {"ranks": bundle["ranks"][:1], "parts": [p.clone() for p in bundle["parts"][:1]]}
        return wire.encode(short, root="bundle", checksum=True).to_bytes()

    said = []
    for hook in (shorten, None):
        kept = carriers.inject(hook if rank == 0 else None)
        try:
            with get_tensors_parallel(
                torch.full((8,), float(rank)), [0, 1, 2, 3], workspace_path=workspace, timeout=60
            ) as got:
                said.append(f"got {[float(t[0]) for t in got]}")
        except Exception as exc:
            said.append(f"{type(exc).__name__}: {exc}")
        finally:
            carriers.inject(kept)
    return said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--mode", choices=["auto", "collective", "workspace", "matrix"], default="auto")
    parser.add_argument("--every", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if args.mode == "matrix":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the matrix's module
        import test_route_matrix as matrix

        chosen = matrix.combos("two hosts")[:: args.every]
        report = matrix.run_matrix("two hosts", os.environ.get("DU_WORKSPACE"), chosen)
        report["combos"] = chosen
        report["short_bundle"] = short_bundle(os.environ.get("DU_WORKSPACE"))
        report["shm_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("du_"))
        with open(os.path.join(os.environ["DU_RESULTS"], f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    routes = Routes()
    logger = logging.getLogger("distribute_utils.roles")
    logger.addHandler(routes)
    logger.setLevel(logging.DEBUG)
    workspace = None if args.mode == "collective" else os.environ.get("DU_WORKSPACE")
    transport = "auto" if args.mode != "workspace" else "workspace"
    everyone = list(range(world))
    wrong: list[str] = []
    for i in range(args.rounds):
        order = everyone[i % world :] + everyone[: i % world]  # every rank receives in turn
        with get_tensors_parallel(
            sample(rank, i), order, workspace_path=workspace, transport=transport, timeout=120
        ) as got:
            for r, t in zip(order, got):
                want = sample(r, i)
                if t.dtype != want.dtype or not torch.equal(t.view(torch.uint8), want.view(torch.uint8)):
                    wrong.append(f"round {i} tensor from {r}")
        config = {"round": i, "rank": rank, "t": sample(rank, i + 1)[:10], "none": None} if rank % 3 else None
        with get_configs_parallel(config, order, None, workspace, transport=transport, timeout=120) as got:
            for r, c in zip(order, got):
                if (c is None) != (r % 3 == 0) or (c is not None and (c["rank"] != r or c["round"] != i)):
                    wrong.append(f"round {i} config from {r}")
    # Pairs inside one node and across nodes (ranks 0,1 on node 0; 2,3 on node 1).
    for pair in ([0, 1], [2, 3], [0, 2]):
        with get_tensors_parallel(
            torch.tensor([rank]), pair, workspace_path=workspace, transport=transport, timeout=120
        ) as got:
            if got and [int(t) for t in got] != pair:
                wrong.append(f"pair {pair}: {got}")
    # Pooled segments across a hierarchical gather: rank 1 sends to rank 0 on its host, rank 3 to its host's
    # leader (rank 2), which forwards a bundle. Every segment a receiver or a leader has let go must be
    # reported back to its sender (a segment never reported stays busy, and allocated, for good).
    del got
    big = torch.full((64 * 1024,), float(rank))  # 256 KiB: pooled
    for _ in range(5):
        with get_tensors_parallel(
            big, everyone, workspace_path=workspace, transport=transport, timeout=120
        ) as got:
            pass
    del got
    # This gather carries the reports of the last round's segments.
    with get_tensors_parallel(
        torch.ones(1), everyone, workspace_path=workspace, transport=transport, timeout=120
    ) as got:
        if got and [float(t) for t in got] != [1.0] * world:
            wrong.append(f"report-carrying gather: {got}")
    release_shared_memory()  # free segments go now; only busy ones stay
    pooled = list(pooled_bytes())
    # Shared memory forced across hosts: the same clear error on every rank, nothing written.
    try:
        with get_tensors_parallel(torch.ones(4), [0, 2], transport="shm", timeout=120):
            forced_shm = "no error"
    except Exception as exc:
        forced_shm = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    report = {
        "rank": rank,
        "wrong": wrong,
        "forced_shm": forced_shm,
        "routes": routes.seen,
        "shm_left": sorted(n for n in os.listdir("/dev/shm") if n.startswith("du_")),
        "pooled_after_release": pooled,
    }
    with open(os.path.join(os.environ["DU_RESULTS"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
