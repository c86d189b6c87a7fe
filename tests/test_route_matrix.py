"""The route matrix: every way a payload can travel, x the sender's device x the device asked for x the
call x one host or two, each run for real and checked the same way (exact values, devices as
docs/api.md "Devices" says, nothing left behind).

The routes come from the code that chooses them: every carrier kind of ``carriers.KINDS`` (a shared
memory segment split by what its receipt says: pooled or named, and registered with CUDA when its
payload is on a GPU), plus the one route that is a plan and not a carrier (a remote host's bundle,
forwarded by its leader). ``test_every_carrier_is_in_the_matrix`` fails for a kind that no recipe here
makes happen, so a new carrier joins the matrix as soon as it is registered. A combination that cannot
happen is in :data:`CANNOT_HAPPEN` with why.

- One host, CPU (default suite, whole): a dedicated job of 4 ranks in which rank 3 cannot listen for
  direct messages (as when its sockets are refused), so that a list naming it takes the store round
  (claims in the store, small payloads inline in them) while lists without it take the direct round.
- One host, CUDA (gpu-marked): senders on the GPU, CUDA asked for.
- Two hosts: simulated nodes (``tests/jobs/multinode_gather_job.py --mode matrix``, test_multinode.py;
  a sample of the combinations in the default suite, every one behind the slow marker). There
  ``device="meta"`` stands in for a GPU on this CPU machine: a device other than the CPU to decode to
  (a bundle's parts must not go there before they are decoded).

The route each payload took is read at the carriers' fault point ``"fetching"`` (the documented seam:
the carrier the receiving side fetched with, and its receipt), on every rank (a host's leader fetches
its members' payloads).
"""

from __future__ import annotations

import errno
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from distribute_utils import sync
from distribute_utils.transports import carriers

from harness import RankPool, job_leftovers

SMALL = 1024  # travels in the claim (attached in a direct round, inline in a store round)
LARGE = 512 * 1024  # past every size that travels in a claim: a segment, or what the transport says


class Recipe(NamedTuple):
    """How a route is made to happen: the transport, the payload's size, whether a workspace is given,
    the ranks lists (for one gather, and disjoint sub-lists each to its own first rank), and the carrier
    kind each receiving rank must see from each of its senders (``{(receiver, sender): kind}`` with the
    receipt's prefix for segments, for a combination's first call; a host's leader receives too)."""

    transport: str
    nbytes: int
    workspace: bool
    lists: tuple[list[int], ...]
    sub_lists: tuple[list[int], ...]
    seen: dict[tuple[int, int], str]
    sub_seen: dict[tuple[int, int], str]


# One host (rank 3 cannot listen: lists that name it take the store round).
ONE_HOST = {
    "attached": Recipe("auto", SMALL, False, ([0, 1, 2],), ([2, 1], [0]), {(0, 1): "attached", (0, 2): "attached"}, {(2, 1): "attached"}),
    "inline": Recipe("auto", SMALL, False, ([0, 1, 2, 3],), ([3, 1], [0]), {(0, r): "inline" for r in (1, 2, 3)}, {(3, 1): "inline"}),
    "pooled segment": Recipe("auto", LARGE, False, ([0, 1, 2],), ([2, 1], [0]), {(0, 1): "shm p:", (0, 2): "shm p:"}, {(2, 1): "shm p:"}),
    "named segment": Recipe("auto", LARGE, False, ([0, 1, 2],), ([2, 1], [0]), {(0, 1): "shm n:", (0, 2): "shm n:"}, {(2, 1): "shm n:"}),
    "workspace file": Recipe("workspace", LARGE, True, ([0, 1, 2, 3],), ([1, 2], [0, 3]), {(0, r): "workspace" for r in (1, 2, 3)}, {(1, 2): "workspace", (0, 3): "workspace"}),
    "collective": Recipe("collective", LARGE, False, ([0, 1, 2, 3],), ([1, 2], [0, 3]), {(0, r): "collective" for r in (1, 2, 3)}, {(1, 2): "collective", (0, 3): "collective"}),
}  # fmt: skip
# One host with a GPU: a sender's GPU payload goes by CUDA IPC where its first rank wants a GPU, else
# through a pooled segment registered with CUDA (the same receipt as any pooled one).
ON_A_GPU = {
    "cuda_ipc": Recipe("auto", LARGE, False, ([0, 1, 2],), ([2, 1], [0]), {(0, 1): "cuda_ipc", (0, 2): "cuda_ipc"}, {(2, 1): "cuda_ipc"}),
    "registered segment": ONE_HOST["pooled segment"],
}  # fmt: skip
# Two hosts: ranks 0 and 1 on one, 2 and 3 on the other; every list spanning both takes the store round.
TWO_HOSTS = {
    "bundle over the workspace": Recipe("auto", LARGE, True, ([0, 1, 2, 3],), ([2, 0, 1], [3]), {(0, 1): "shm p:", (0, 2): "workspace", (2, 3): "shm p:"}, {(2, 0): "workspace", (0, 1): "shm p:"}),
    "bundle over the collective": Recipe("auto", LARGE, False, ([0, 1, 2, 3],), ([2, 0, 1], [3]), {(0, 1): "shm p:", (0, 2): "collective", (2, 3): "shm p:"}, {(2, 0): "collective", (0, 1): "shm p:"}),
    "workspace file": Recipe("workspace", LARGE, True, ([0, 1, 2, 3],), ([2, 0], [1, 3]), {(0, r): "workspace" for r in (1, 2, 3)}, {(2, 0): "workspace", (1, 3): "workspace"}),
    "collective": Recipe("collective", SMALL, False, ([0, 1, 2, 3],), ([2, 0], [1, 3]), {(0, r): "collective" for r in (1, 2, 3)}, {(2, 0): "collective", (1, 3): "collective"}),
}  # fmt: skip
MATRICES = {"one host": ONE_HOST, "on a GPU": ON_A_GPU, "two hosts": TWO_HOSTS}
ELSEWHERE = {
    "local_disk": "only where /dev/shm has no room: tests/test_small_shm.py runs a job in a private, small one",
}
"""Carriers made to happen by another test, and why not here."""
SENDER_DEVICES = {"one host": ("cpu", "meta"), "on a GPU": ("cuda",), "two hosts": ("cpu", "meta")}
ASKED_DEVICES = {
    "one host": (None, "cpu"),
    "on a GPU": (None, "cpu", "cuda"),
    "two hosts": (None, "cpu", "meta"),
}
CALLS = ("tensor", "config", "sub-list")
CANNOT_HAPPEN = {
    ("pooled segment", "meta"): "a meta tensor has no bytes: its payload is a header, which travels in the claim",
    ("named segment", "meta"): "as the pooled segment: a meta payload never needs a segment",
    ("cuda_ipc", "cuda", "cpu", "tensor"): "a first rank that wants tensors on the CPU gets no IPC handles",
    ("cuda_ipc", "cuda", None, "tensor"): "tensors are yielded on the CPU by default: no IPC handles",
    ("cuda_ipc", "cuda", "cpu", "config"): "configs asked for on the CPU: no IPC handles",
    ("cuda_ipc", "cuda", "cpu", "sub-list"): "as the config asked for on the CPU",
    ("registered segment", "cuda", "cuda"): "a first rank that wants a GPU gets IPC handles instead",
    ("registered segment", "cuda", None, "config"): "configs stay on their senders' GPUs: IPC handles",
    ("registered segment", "cuda", None, "sub-list"): "as the config",
}  # fmt: skip
"""Combinations that cannot happen, by (route, sender's device[, device asked[, call]]), with why."""


def cannot_happen(combo: Sequence[Any]) -> bool:
    route, sender, asked = combo[:3]
    return any(key in CANNOT_HAPPEN for key in ((route, sender), (route, sender, asked), tuple(combo)))


def combos(matrix: str) -> list[tuple[str, str, str | None, str]]:
    """Every combination of ``matrix`` that can happen, in a fixed order."""
    return [
        (route, sender, asked, call)
        for route in MATRICES[matrix]
        for sender in SENDER_DEVICES[matrix]
        for asked in ASKED_DEVICES[matrix]
        for call in CALLS
        if not cannot_happen((route, sender, asked, call))
    ]


def lists_of(recipe: Recipe, call: str, world: int = 4) -> dict[int, list[int]]:
    """Each rank's ranks list for ``call`` (every rank of the world enters every call: ``group`` is the
    world); a rank no list names only checks in, passing the first list."""
    lists = recipe.sub_lists if call == "sub-list" else recipe.lists
    found = {r: ranks for ranks in lists for r in ranks}
    return {r: found.get(r, lists[0]) for r in range(world)}


def sample(rank: int, index: int, nbytes: int, device: str) -> torch.Tensor:
    return (torch.arange(nbytes // 4, dtype=torch.float32) + 1000 * rank + index).to(device)


def _value(call: str, rank: int, index: int, nbytes: int, device: str) -> Any:
    tensor = sample(rank, index, nbytes, device)
    return tensor if call == "tensor" else {"t": tensor, "rank": rank, "none": None}


def run_matrix(
    matrix: str, workspace: str | None, chosen: list[tuple[str, str, str | None, str]]
) -> dict[str, Any]:
    """On every rank: the combinations ``chosen`` of ``matrix`` in turn (the same order everywhere); what
    each rank was yielded and which carriers it fetched with."""
    from distribute_utils import get_configs_parallel, get_tensors_parallel, mailbox

    rank = dist.get_rank()
    if matrix == "one host" and rank == 3:

        def refuse(point: str, what: str) -> None:
            if point == "listen":
                raise PermissionError(errno.EACCES, "refused by the test")

        mailbox.inject(refuse)
    seen: list[tuple[int, str]] = []

    def look(point: str, sender: int, carrier: Any, receipt: Any) -> None:
        if point == "fetching":
            segment = f" {receipt[:2]}" if carrier.kind == "shm" else ""
            seen.append((sender, carrier.kind + segment))

    kept = carriers.inject(look)
    out: dict[str, Any] = {"rank": rank, "results": []}
    for index, combo in enumerate(chosen):
        route, sender_device, asked, call = combo
        recipe = MATRICES[matrix][route]
        ranks = lists_of(recipe, call)[rank]
        gather: Callable[..., Any] = get_tensors_parallel if call == "tensor" else get_configs_parallel
        options: dict[str, Any] = {"transport": recipe.transport, "device": asked, "timeout": 120}
        if recipe.workspace:
            options["workspace_path"] = workspace
        # Every view of the last combination is gone, and its senders heard so (a notice, read at their
        # next send): each sender's pooled segments are free now, whatever came before.
        dist.barrier()
        held: list[Any] | None = []
        if route == "named segment":  # each sender's two pooled segments held by its first rank's views
            for extra in range(2):
                with gather(_value(call, rank, extra, recipe.nbytes, "cpu"), ranks, **options) as got:
                    held.append(got)
        seen.clear()
        value = _value(call, rank, index, recipe.nbytes, sender_device)
        try:
            with gather(value, ranks, **options) as got:
                result = {"got": _describe(got, call), "own": bool(got) and got[0] is value}
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        got = held = None  # (no view outlives its combination)
        result.update(combo=list(combo), seen=sorted(set(seen)))
        out["results"].append(result)
    carriers.inject(kept)
    dist.barrier()
    if rank == 0:  # claims and verdicts of store rounds still in the store (collected as calls go on)
        store = dist.distributed_c10d._get_default_store()
        out["claim_keys"] = sum(k.count("/c/") + k.count("/v/") for k in store.list_keys())
    return out


def _describe(got: list[Any], call: str) -> list[Any]:
    """What each yielded value is: (device, dtype, shape, a digest of its bytes or None for meta, config
    fields)."""
    described = []
    for item in got:
        tensor = item if call == "tensor" else item["t"]
        data = None if tensor.is_meta else _digest(tensor)
        fields = None if call == "tensor" else [item["rank"], item["none"]]
        described.append([str(tensor.device), str(tensor.dtype), list(tensor.shape), data, fields])
    return described


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def expected_device(sender_device: str, asked: str | None, call: str) -> str:
    """docs/api.md "Devices": a meta tensor stays meta; every other tensor goes to the device asked for,
    else to the CPU (tensor gathers) or where its sender had it (config gathers: ``cuda:0`` for a sender
    on the one GPU of a one-GPU machine)."""
    if sender_device == "meta":
        return "meta"
    if asked is not None:
        return "cuda:0" if asked == "cuda" else asked
    return "cpu" if call == "tensor" or sender_device == "cpu" else "cuda:0"


def check(
    matrix: str, chosen: list[tuple[str, str, str | None, str]], reports: list[dict[str, Any]]
) -> list[Any]:
    """Every combination's results on every rank against what docs/api.md promises; the failures."""
    failures: list[Any] = []
    for index, combo in enumerate(chosen):
        route, sender_device, asked, call = combo
        recipe = MATRICES[matrix][route]
        lists = lists_of(recipe, call)
        want_seen = recipe.sub_seen if call == "sub-list" else recipe.seen
        for rank, report in enumerate(reports):
            result = next(r for r in report["results"] if r["combo"] == list(combo))
            ranks = lists[rank]
            seen = {(rank, sender): kind for sender, kind in result["seen"]}
            want = {key: kind for key, kind in want_seen.items() if key[0] == rank}
            if sender_device == "meta":  # (a meta payload is a header: within a host it goes in the claim)
                want = {key: "inline" if kind.startswith("shm") else kind for key, kind in want.items()}
            if "error" in result:
                failures.append((combo, rank, result["error"]))
                continue
            if seen != want:
                failures.append(
                    (combo, rank, "fetched another way", sorted(seen.items()), "want", sorted(want.items()))
                )
            if rank != ranks[0]:
                if result["got"] != []:
                    failures.append((combo, rank, "a rank that does not receive was yielded something"))
                continue
            device = expected_device(sender_device, asked, call)
            expected = [
                [
                    device,
                    "torch.float32",
                    [recipe.nbytes // 4],
                    None if device == "meta" else _digest(sample(r, index, recipe.nbytes, "cpu")),
                    None if call == "tensor" else [r, None],
                ]
                for r in ranks
            ]
            if result["got"] != expected:
                failures.append((combo, rank, "values or devices", [g[:3] for g in result["got"]]))
            if not result["own"] and device in (sender_device, "cpu") and sender_device != "cuda":
                failures.append((combo, rank, "its own value was copied although nothing of it moves"))
    return failures


def claim_keys_bound(world: int) -> int:
    """Claims and verdicts a job may hold in its store at a time: those of the calls since the last
    collection (every :data:`sync.COLLECT_EVERY` calls of a group), per rank, plus one call's."""
    return 2 * world * (sync.COLLECT_EVERY + 1)


def test_every_carrier_is_in_the_matrix() -> None:
    """Each carrier the code can choose is made to happen by a recipe of the matrix; both segment receipts too."""
    made = {
        kind.split()[0]
        for m in MATRICES.values()
        for r in m.values()
        for kind in [*r.seen.values(), *r.sub_seen.values()]
    }
    assert set(carriers.KINDS) == made | set(ELSEWHERE), (
        f"carriers nothing makes happen: {set(carriers.KINDS) - made}"
    )
    receipts = {kind for r in ONE_HOST.values() for kind in r.seen.values() if kind.startswith("shm")}
    assert receipts == {"shm p:", "shm n:"}, receipts


def test_the_single_host_matrix_on_the_cpu(fresh_job: Callable[[int], RankPool], tmp_path: Path) -> None:
    """Every CPU combination on one host (60: 6 routes x 2 sender devices x 2 asked devices x 3 calls,
    less the 12 that cannot happen), in one dedicated job; then nothing of the job is left in /dev/shm
    (its segments, records, sockets), in the workspace, or in the store beyond the calls not collected yet."""
    chosen = combos("one host")
    assert len(chosen) == 6 * 2 * 2 * 3 - 2 * 2 * 3
    workspace = tmp_path / "ws"
    workspace.mkdir()
    job = fresh_job(4)
    reports = job.run(run_matrix, "one host", str(workspace), chosen, timeout=300)
    failures = check("one host", chosen, reports)
    assert failures == [], "\n".join(map(str, failures[:10])) + f"\n({len(failures)} failures)"
    assert reports[0]["claim_keys"] <= claim_keys_bound(4), reports[0]["claim_keys"]
    left = {p for p in job_leftovers(set(job.pids)) if not p.endswith(".sock")}
    assert left == set(), f"left in /dev/shm while the job runs: {sorted(left)}"
    job.close()  # (politely: the ranks leave as a finished job does)
    assert job_leftovers(set(job.pids)) == set(), "left in /dev/shm by the finished job"
    assert [p.name for p in workspace.iterdir() if not p.name.startswith(".du-")] == [], (
        "left in the workspace"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_the_single_host_matrix_on_a_gpu(fresh_job: Callable[[int], RankPool], tmp_path: Path) -> None:
    """Every CUDA combination on one host: senders on the GPU (all 4 ranks share it), asked for nothing,
    the CPU or the GPU; CUDA IPC where the first rank wants a GPU, a registered pooled segment where it
    does not; and the CPU routes again with the GPU asked for (but the named segment: a first rank that
    copies to its GPU keeps no view of a segment, so its sender never runs out of pooled ones)."""
    parts = {  # (the CPU routes first: rank 3 must refuse to listen before its first gather)
        "one host": [
            (route, "cpu", "cuda", call) for route in ONE_HOST if route != "named segment" for call in CALLS
        ],
        "on a GPU": combos("on a GPU"),
    }
    workspace = tmp_path / "ws"
    workspace.mkdir()
    job = fresh_job(4)
    failures = []
    for matrix, chosen in parts.items():
        reports = job.run(run_matrix, matrix, str(workspace), chosen, timeout=300)
        failures += check(matrix, chosen, reports)
    assert failures == [], "\n".join(map(str, failures[:10])) + f"\n({len(failures)} failures)"
    job.close()
    assert job_leftovers(set(job.pids)) == set(), "left in /dev/shm by the finished job"
    assert [p.name for p in workspace.iterdir() if not p.name.startswith(".du-")] == [], (
        "left in the workspace"
    )
