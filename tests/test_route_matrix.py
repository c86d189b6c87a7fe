"""The route matrix: every way a payload can travel, x the sender's device x the device asked for x the
call, each run for real and checked the same way (exact values, devices as docs/api.md "Devices" says,
nothing left behind).

The routes come from the code that chooses them: every carrier kind of ``carriers.KINDS`` (a shared
memory segment split by what its receipt says: pooled or named), plus the one route that is a plan and
not a carrier (a remote host's bundle, forwarded by its leader). ``test_every_route_is_in_the_matrix``
fails for a kind with no recipe here and no reason why it cannot run, so a new carrier joins the matrix
as soon as it is registered. A combination that cannot happen is listed in :data:`CANNOT_HAPPEN` with
why; CUDA combinations are in the gpu-marked test; two hosts run in simulated nodes (test_multinode.py,
its job's ``matrix`` mode).

One host: a dedicated job of 4 ranks in which rank 3 cannot listen for direct messages (as when its
sockets are refused), so that a list naming it takes the store round (claims in the store, small
payloads inline in them) while lists without it take the direct round (small payloads attached to the
claim message). The route each payload took is read at the carriers' fault point ``"fetching"`` (the
documented seam: the carrier the receiving side fetched with, and its receipt).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distribute_utils.transports import carriers

from harness import RankPool, job_leftovers

ATTACHED_BYTES = 1024  # travels in the claim (attached in a direct round, inline in a store round)
SEGMENT_BYTES = 512 * 1024  # past every size that travels in a claim: a segment
ROUTES = {
    # route: (carrier kind, receipt prefix or None, transport, payload bytes, lists by call)
    "attached": ("attached", None, "auto", ATTACHED_BYTES),
    "inline": ("inline", None, "auto", ATTACHED_BYTES),
    "pooled segment": ("shm", "p:", "auto", SEGMENT_BYTES),
    "named segment": ("shm", "n:", "auto", SEGMENT_BYTES),
    "workspace file": ("workspace", None, "workspace", SEGMENT_BYTES),
    "collective": ("collective", None, "collective", SEGMENT_BYTES),
}
"""The single-host routes this module runs on the CPU, with how each is made to happen."""
GPU_ONLY = {
    "cuda_ipc": "CUDA IPC hands out handles to GPU memory (tests/test_cuda_ipc.py, gpu-marked)",
    "registered segment": "a pooled segment registered with CUDA, for GPU payloads (gpu-marked)",
}
ACROSS_HOSTS = {
    "remote host's bundle": "needs two hosts: test_multinode.py runs its job's matrix mode",
}
CANNOT_HAPPEN = {
    ("pooled segment", "meta"): "a meta tensor has no bytes: its payload is a header, small enough "
    "to travel in the claim",
    ("named segment", "meta"): "as the pooled segment: a meta payload never needs a segment",
}
SENDER_DEVICES = ("cpu", "meta")
ASKED_DEVICES = (None, "cpu")
CALLS = ("tensor", "config", "sub-list")


def _lists(route: str, call: str) -> dict[int, list[int]]:
    """Each rank's ranks list for ``call`` (every rank of the world enters every call: ``group`` is the
    world): one gather, or disjoint sub-lists each to its own first rank (ModelOpt's pipeline merges).
    A store round's lists name rank 3; a direct round's do not, and rank 3 only checks in, passing the
    first list."""
    store_round = route == "inline"
    if call != "sub-list":
        ranks = [0, 1, 2, 3] if store_round or route in ("workspace file", "collective") else [0, 1, 2]
        lists = [ranks]
    elif store_round:
        lists = [[3, 1], [0]]  # (rank 2 checks in: every list of a store round names rank 3)
    elif route in ("workspace file", "collective"):
        lists = [[1, 2], [0, 3]]
    else:
        lists = [[2, 1], [0]]
    found = {r: ranks for ranks in lists for r in ranks}
    return {r: found.get(r, lists[0]) for r in range(4)}


def _sample(rank: int, index: int, nbytes: int, device: str) -> torch.Tensor:
    return (torch.arange(nbytes // 4, dtype=torch.float32) + 1000 * rank + index).to(device)


def _value(call: str, rank: int, index: int, nbytes: int, device: str) -> Any:
    tensor = _sample(rank, index, nbytes, device)
    return tensor if call == "tensor" else {"t": tensor, "rank": rank, "none": None}


def _matrix(workspace: str, combos: list[tuple[str, str, str | None, str]]) -> dict[str, Any]:
    """Every combination in turn on every rank (the same order everywhere); what each first rank saw."""
    from distribute_utils import get_configs_parallel, get_tensors_parallel, mailbox

    rank = dist.get_rank()
    if rank == 3:

        def refuse(point: str, what: str) -> None:
            if point == "listen":
                raise PermissionError(errno.EACCES, "refused by the test")

        mailbox.inject(refuse)
    seen: list[tuple[int, str, str]] = []

    def look(point: str, sender: int, carrier: Any, receipt: Any) -> None:
        if point == "fetching":
            seen.append((sender, carrier.kind, receipt if isinstance(receipt, str) else ""))

    carriers.inject(look)
    out: dict[str, Any] = {"rank": rank, "results": []}
    for index, (route, sender_device, asked, call) in enumerate(combos):
        transport, nbytes = ROUTES[route][2:]
        ranks = _lists(route, call)[rank]
        gather: Callable[..., Any] = get_tensors_parallel if call == "tensor" else get_configs_parallel
        options = {"transport": transport, "device": asked, "timeout": 60}
        if transport == "workspace":
            options["workspace_path"] = workspace
        # Every view of the last combination is gone, and its senders heard so (a notice, read at their
        # next send): each sender's pooled segments are free now, whatever came before.
        dist.barrier()
        held: list[Any] = []
        if route == "named segment":  # the sender's two pooled segments held by its first rank's views
            for extra in range(2):
                with gather(_value(call, rank, extra, nbytes, "cpu"), ranks, **options) as got:
                    held.append(got)
        seen.clear()
        value = _value(call, rank, index, nbytes, sender_device)
        try:
            with gather(value, ranks, **options) as got:
                result = {"got": _describe(got, call), "value_is_own": bool(got) and got[0] is value}
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        got = held = None  # (no view outlives its combination)
        result.update(combo=[route, sender_device, asked, call], ranks=ranks, routes=sorted(set(seen)))
        out["results"].append(result)
    carriers.inject(None)
    dist.barrier()
    return out


def _describe(got: list[Any], call: str) -> list[Any]:
    """What each yielded value is: (device, dtype, shape, its bytes or None for meta, config fields)."""
    described = []
    for item in got:
        tensor = item if call == "tensor" else item["t"]
        data = None if tensor.is_meta else tensor.cpu().numpy().tobytes()
        fields = None if call == "tensor" else (item["rank"], item["none"])
        described.append((str(tensor.device), str(tensor.dtype), list(tensor.shape), data, fields))
    return described


def _combos() -> list[tuple[str, str, str | None, str]]:
    return [
        (route, sender, asked, call)
        for route in ROUTES
        for sender in SENDER_DEVICES
        for asked in ASKED_DEVICES
        for call in CALLS
        if (route, sender) not in CANNOT_HAPPEN
    ]


def _expected_device(sender_device: str, asked: str | None) -> str:
    """docs/api.md "Devices", for tensors sent from the CPU or meta: a meta tensor stays meta; every other
    goes to the device asked for, else to the CPU (tensor gathers) or where its sender had it (configs:
    the CPU here)."""
    return "meta" if sender_device == "meta" else asked or "cpu"


def _check(combos: list[Any], reports: list[dict[str, Any]]) -> list[Any]:
    """Every combination's results on every rank against what docs/api.md promises; the failures."""
    failures: list[Any] = []
    for index, combo in enumerate(combos):
        route, sender_device, asked, call = combo
        kind, prefix, _, nbytes = ROUTES[route]
        lists = _lists(route, call)
        for rank, report in enumerate(reports):
            result = next(r for r in report["results"] if r["combo"] == list(combo))
            ranks = lists[rank]
            if "error" in result:
                failures.append((combo, rank, result["error"]))
            elif rank != ranks[0]:
                if result["got"] != []:
                    failures.append((combo, rank, "a rank that does not receive was yielded something"))
            else:
                want = [
                    (
                        _expected_device(sender_device, asked),
                        "torch.float32",
                        [nbytes // 4],
                        None
                        if sender_device == "meta"
                        else _sample(r, index, nbytes, "cpu").numpy().tobytes(),
                        None if call == "tensor" else (r, None),
                    )
                    for r in ranks
                ]
                if result["got"] != want or not result["value_is_own"]:
                    failures.append((combo, rank, "values or devices", [g[:3] for g in result["got"]]))
                routes = {(s, k, receipt[:2] if prefix else None) for s, k, receipt in result["routes"]}
                if routes != {(s, kind, prefix) for s in ranks[1:]}:
                    failures.append((combo, rank, "another route", result["routes"]))
    return failures


def test_every_route_is_in_the_matrix() -> None:
    """Each carrier the code can choose has a recipe here or a reason it cannot run on this machine."""
    covered = {kind for kind, *_ in ROUTES.values()} | set(GPU_ONLY)
    assert set(carriers.KINDS) <= covered, (
        f"carriers with no route in the matrix: {set(carriers.KINDS) - covered}"
    )
    assert {p for _, p, *_ in ROUTES.values() if p} == {"p:", "n:"}, "both kinds of segment receipts"


def test_the_single_host_matrix_on_the_cpu(fresh_job: Callable[[int], RankPool], tmp_path: Path) -> None:
    """Every CPU combination on one host (60: 6 routes x 2 sender devices x 2 asked devices x 3 calls,
    less the 12 that cannot happen), in one dedicated job; then nothing of the job is left in /dev/shm
    (its segments, records) but the sockets of its live ranks, nor in the workspace."""
    combos = _combos()
    assert len(combos) == 6 * 2 * 2 * 3 - 2 * 2 * 3
    workspace = tmp_path / "ws"
    workspace.mkdir()
    job = fresh_job(4)
    reports = job.run(_matrix, str(workspace), combos, timeout=300)
    failures = _check(combos, reports)
    assert failures == [], "\n".join(map(str, failures[:10])) + f"\n({len(failures)} failures)"
    left = {p for p in job_leftovers(set(job.pids)) if not p.endswith(".sock")}
    assert left == set(), f"left in /dev/shm while the job runs: {sorted(left)}"
    job.close()  # (politely: the ranks leave as a finished job does)
    assert job_leftovers(set(job.pids)) == set(), "left in /dev/shm by the finished job"
    assert [p.name for p in workspace.iterdir() if not p.name.startswith(".du-")] == [], (
        "left in the workspace"
    )
