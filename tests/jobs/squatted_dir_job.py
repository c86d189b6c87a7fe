"""A 2-rank job (``launch.run_local``) whose gathers report their values and the claims they left in the store.

Run by test_shared_machine.py inside a private mount namespace whose /dev/shm holds this user's private
directory made first by another user; prints one JSON line: every rank's report.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import torch.distributed as dist

from distribute_utils import get_configs_parallel, get_tensors_parallel
from distribute_utils.launch import run_local

CLAIM_KEY = re.compile(r".*/\d+/[cv]/\d+")  # a store round's claims and verdicts (docs/api.md)


def _claim_keys() -> int:
    store = dist.distributed_c10d._get_default_store()
    return sum(bool(CLAIM_KEY.fullmatch(k)) for k in store.list_keys())


def gather() -> dict[str, Any]:
    rank = dist.get_rank()
    before = _claim_keys()
    with get_tensors_parallel(torch.arange(1000, dtype=torch.float32) + rank, [0, 1], timeout=60) as got:
        tensors = [
            t.tolist() == (torch.arange(1000, dtype=torch.float32) + r).tolist() for r, t in enumerate(got)
        ]
    with get_configs_parallel({"rank": rank}, [0, 1], timeout=60) as configs:
        seen = [c["rank"] for c in configs]
    return {"rank": rank, "tensors": tensors, "configs": seen, "claims": _claim_keys() - before}


if __name__ == "__main__":
    print(json.dumps(run_local(gather, 2, timeout=120)))
