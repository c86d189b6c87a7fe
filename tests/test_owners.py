"""State lives as long as its owner: the default process group's scope, or the process's (owners.py).

- Importing every module of the package starts no thread, registers no atexit hook and no at-fork hook
  but the one the package states (``owners``), and writes no file.
- A group's pool, kept maps and job token are closed when the group is destroyed and re-made in the
  same process; the next group starts with its own, empty; a carrier used with no group keeps its
  state in the process scope, which lives on.
- A destroyed group whose object the job still holds (a DDP module, a DeviceMesh) keeps nothing: the
  first call of ours without a default group closes its scope.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist

from distribute_utils import get_configs_parallel, get_tensors_parallel
from distribute_utils.incarnation import incarnation
from distribute_utils.owners import owned, process_owned
from distribute_utils.transports import shm
from distribute_utils.transports.kept_maps import KeptMaps
from distribute_utils.transports.namespace import JobToken, job_token
from distribute_utils.transports.segment_pool import FreedReports, SegmentPool

from harness import RankPool, remake_group

# Run in a fresh interpreter: third-party modules first (their own hooks are theirs), then every module
# of the package, recording what the import does.
_IMPORT_ALL = r"""
import atexit, json, os, pkgutil, sys, threading, importlib
import torch, torch.distributed, msgpack, filelock, numpy

def name(f):
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"

found = {"fork": [], "atexit": [], "threads": [], "writes": []}
real_fork, real_atexit = os.register_at_fork, atexit.register

def fork_hook(**hooks):
    found["fork"].append({k: name(v) for k, v in hooks.items()})
    return real_fork(**hooks)

def exit_hook(f, *args, **kwargs):
    found["atexit"].append(name(f))
    return real_atexit(f, *args, **kwargs)

WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT

def audit(event, args):
    if event == "open":
        path, mode, flags = args
        if (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & WRITE):
            found["writes"].append(str(path))
    elif event in ("os.mkdir", "os.rename", "os.symlink", "os.link"):
        found["writes"].append(f"{event} {args[0]}")
    elif event == "_thread.start_new_thread":
        found["threads"].append(name(args[0]))

os.register_at_fork, atexit.register = fork_hook, exit_hook
sys.addaudithook(audit)
before = threading.active_count()
import distribute_utils
modules = ["distribute_utils"]
for info in pkgutil.walk_packages(distribute_utils.__path__, "distribute_utils."):
    if info.name.endswith("__main__"):  # (running it is the CLI)
        continue
    importlib.import_module(info.name)
    modules.append(info.name)
found["modules"] = len(modules)
found["thread_count"] = threading.active_count() - before
print(json.dumps(found))
"""


def test_importing_the_package_has_no_side_effect_but_the_one_fork_hook(tmp_path: Any) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, check=True, cwd=tmp_path, env=env
    ).stdout
    found = json.loads(out.splitlines()[-1])
    assert found["modules"] > 40, found
    ours = [hook for hook in found["fork"] if any(v.startswith("distribute_utils.") for v in hook.values())]
    assert len(ours) == 1 and list(ours[0]) == ["after_in_child"], found["fork"]
    assert ours[0]["after_in_child"].startswith("distribute_utils.owners."), "the one hook the package states"
    assert [f for f in found["atexit"] if f.startswith("distribute_utils.")] == [], found["atexit"]
    assert found["threads"] == [] and found["thread_count"] == 0, found
    assert found["writes"] == [], found["writes"]
    assert os.listdir(tmp_path) == []


def test_without_a_group_a_carrier_keeps_its_state_in_the_process_scope() -> None:
    assert not dist.is_initialized()
    pool = owned(SegmentPool)
    assert pool is process_owned(SegmentPool) and owned(KeptMaps) is process_owned(KeptMaps)
    assert shm.SharedMemoryTransport.reports is process_owned(FreedReports) is shm.REPORTS
    assert owned(SegmentPool) is pool, "one per owner"


def _state_across_groups(tag: str) -> dict[str, Any]:
    rank, ranks = dist.get_rank(), [0, 1]
    value = torch.full((300_000,), float(rank))  # 1.2 MB: a pooled segment, its map kept by rank 0
    for _ in range(2):
        with get_tensors_parallel(value, ranks, timeout=30) as got:
            pass
        del got
        gc.collect()
    old = {"pool": owned(SegmentPool), "kept": owned(KeptMaps), "token": owned(JobToken)}
    assert incarnation().own(SegmentPool) is old["pool"], "the incarnation holds the group's scope"
    job_token()
    before = {"pooled": old["pool"].held(), "kept": old["kept"].held()}
    remake_group(rank, f"owners/{tag}")
    kinds = {"pool": SegmentPool, "kept": KeptMaps, "token": JobToken}
    after = {
        "fresh": [owned(kind) is not old[what] for what, kind in kinds.items()],  # (the new group's scope)
        "closed": [old["pool"].closed, old["kept"].held()],
        "new_pool": owned(SegmentPool).held(),
        "new_kept": owned(KeptMaps).held(),
        "new_token": owned(JobToken).token,
    }
    with get_configs_parallel({"rank": rank}, ranks, timeout=30) as got:
        ranks_seen = [c["rank"] for c in got]
    dist.barrier()
    return {**before, **after, "ranks": ranks_seen, "old_pool_open": old["pool"].held()}


def test_state_does_not_outlive_its_group(pools: Any) -> None:
    """Destroy the default group and make a new one in the same processes: the old group's segment
    pool is closed (its free segments given back), its kept maps forgotten, its job token dropped; the
    new group starts with its own, empty, and gathers on."""
    rank_pool: RankPool = pools.get(2)
    tag = f"{os.getpid()}-{id(rank_pool)}"
    first, sender = rank_pool.run(_state_across_groups, tag, timeout=120)
    assert sender["pooled"][0] >= 1, "the sender published through a pooled segment"
    assert first["kept"][0] >= 1, "the first rank kept its map of the sender's segment"
    for result in (first, sender):
        assert result["closed"] == [True, (0, 0)], result
        assert result["fresh"] == [True, True, True], result
        assert result["new_pool"] == (0, 0) and result["new_kept"] == (0, 0), result
        assert result["new_token"] is None, "the new group agrees on its token anew"
    assert first["ranks"] == [0, 1]
    assert sender["old_pool_open"] == (0, 0), "the old group's segments went with it, once freed"


def _destroyed_but_held(tag: str) -> dict[str, Any]:
    rank, ranks = dist.get_rank(), [0, 1]
    value = torch.full((300_000,), float(rank))  # a pooled segment, its map kept by rank 0
    with get_tensors_parallel(value, ranks, timeout=30) as got:
        pass
    del got
    gc.collect()
    dist.barrier()
    pool, kept = owned(SegmentPool), owned(KeptMaps)
    before = {"pooled": pool.held(), "kept": kept.held()}
    held = dist.group.WORLD  # as a DDP module or a DeviceMesh does: the group object outlives its destroy

    def without_a_group() -> dict[str, Any]:
        shm.release_shared_memory()
        return {"closed": pool.closed, "pooled": pool.held(), "kept": kept.held(), "now": shm.pooled_bytes()}

    after = remake_group(rank, f"owners-held/{tag}", without_a_group)
    del held
    return {"before": before, "after": after}


def test_a_destroyed_group_that_is_still_referenced_keeps_nothing(pools: Any) -> None:
    """``destroy_process_group()`` while the job still holds the group object, then
    ``release_shared_memory()``: the group's pool is closed and its kept maps are unmapped (the group's
    finalizer never runs while the object lives)."""
    rank_pool: RankPool = pools.get(2)
    first, sender = rank_pool.run(_destroyed_but_held, f"{os.getpid()}-{id(rank_pool)}", timeout=120)
    assert sender["before"]["pooled"][0] >= 1 and first["before"]["kept"][0] >= 1, (first, sender)
    for result in (first, sender):
        assert result["after"]["closed"] is True, result
        assert result["after"]["kept"] == (0, 0), result
    assert first["after"]["pooled"] == (0, 0) and first["after"]["now"] == (0, 0), first
