"""An NCCL default group, as a job with one GPU per rank has it (gpu-marked).

NCCL needs a GPU per rank, and the GPU machine has one, so the group has one rank: it checks
what runs on the first rank of an NCCL job without a peer (no payload travels). The rank's own
tensors come back exact (on the CPU for a tensor gather, as passed for a config gather) with the
default route and ``transport="collective"`` asked for; a ``ProcessGroupMesh`` makes its groups on
NCCL; its barriers and the package's barrier return; a gather after them is still exact; nothing
is left in ``/dev/shm``. Also with the ``cpu:gloo,cuda:nccl`` backend. Not covered: messages between
two NCCL ranks (they need two GPUs), and whether a barrier launched an NCCL collective (one rank
cannot tell).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distribute_utils.transports.namespace import NAMESPACE_PREFIX
from distribute_utils.transports.shm import SEGMENT_PREFIX

from harness import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]

_ONE_RANK = r"""
import json, os, sys
import torch, torch.distributed as dist
from distribute_utils import ProcessGroupMesh, barrier, get_configs_parallel, get_tensors_parallel

torch.cuda.set_device(0)
dist.init_process_group(sys.argv[1], rank=0, world_size=1)
mine = torch.arange(4096, dtype=torch.bfloat16, device="cuda:0") * 3
config = {"w": mine, "n": 7}
report = {"backend": str(dist.get_backend())}
for transport in ("auto", "collective"):
    with get_tensors_parallel(mine, [0], transport=transport, timeout=60) as got:
        report[f"tensors_{transport}"] = [str(got[0].device), bool(torch.equal(got[0], mine.cpu()))]
    with get_configs_parallel(config, [0], transport=transport, timeout=60) as got:
        report[f"configs_{transport}"] = [got[0] is config, got[0]["w"] is mine]
mesh = ProcessGroupMesh(1, 1, axis_names=("tp", "pp"))
group = mesh.get_group_along_axis("tp")
report["mesh_backend"] = str(dist.get_backend(group))
mesh.barrier()
mesh.barrier("pp")
barrier()
with get_tensors_parallel(mine, mesh.ranks_along_axis("tp"), timeout=60) as got:
    report["after_mesh"] = bool(torch.equal(got[0], mine.cpu()))
mesh.destroy_mesh_process_groups()
dist.destroy_process_group()
print("REPORT " + json.dumps(report))
"""


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_a_one_rank_nccl_group_gathers_exactly(backend: str) -> None:
    before = set(os.listdir("/dev/shm"))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _ONE_RANK, backend], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(line[-1][len("REPORT ") :])
    assert "nccl" in report["backend"] and "nccl" in report["mesh_backend"], report
    for transport in ("auto", "collective"):
        assert report[f"tensors_{transport}"] == ["cpu", True], report
        assert report[f"configs_{transport}"] == [True, True], report
    assert report["after_mesh"] is True, report
    left = {
        n for n in set(os.listdir("/dev/shm")) - before if n.startswith((SEGMENT_PREFIX, NAMESPACE_PREFIX))
    }
    assert not left, f"left in /dev/shm: {sorted(left)}"
