"""torchrun job: gather more than a small /dev/shm can hold; every rank reports what it saw.

Run inside a private mount namespace with a small tmpfs on /dev/shm (see test_small_shm.py).
Writes one JSON file per rank into $DU_RESULTS.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from distribute_utils import get_tensors_parallel

MIB = 2**20


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    per_rank = int(os.environ.get("DU_PER_RANK_MIB", "32")) * MIB
    tensor = torch.ones(per_rank // 4, dtype=torch.float32) * rank
    report: dict = {"rank": rank}
    try:
        with get_tensors_parallel(tensor, list(range(dist.get_world_size())), timeout=60) as got:
            report["received"] = len(got)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    report["shm_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("du_"))
    with open(os.path.join(os.environ["DU_RESULTS"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
