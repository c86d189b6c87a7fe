"""torchrun job: gather more than a small /dev/shm can hold (``$DU_TRANSPORT``, default ``auto``); every
rank reports what it saw.

Run inside a private mount namespace with a small tmpfs on /dev/shm (see test_small_shm.py).
Writes one JSON file per rank into $DU_RESULTS.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from distribute_utils import get_tensors_parallel
from distribute_utils.transports.local_disk import local_dir

MIB = 2**20


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    per_rank = int(os.environ.get("DU_PER_RANK_MIB", "32")) * MIB
    tensor = torch.ones(per_rank // 4, dtype=torch.float32) * rank
    report: dict = {"rank": rank}
    transport = os.environ.get("DU_TRANSPORT", "auto")
    try:
        with get_tensors_parallel(
            tensor, list(range(dist.get_world_size())), transport=transport, timeout=60
        ) as got:
            report["received"] = len(got)
            report["exact"] = all(bool(torch.all(t == r)) for r, t in enumerate(got))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    report["shm_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("du_"))
    local = local_dir()
    report["local_left"] = sorted(os.listdir(local)) if os.path.isdir(local) else []
    with open(os.path.join(os.environ["DU_RESULTS"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
