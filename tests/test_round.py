"""The gather round as real export code calls it (issue: round protocol).

- ModelOpt's TP x PP call pattern: one synchronising group, several disjoint ``ranks`` lists
  at once, each delivered to its own first rank.
- Lists that overlap but differ: ValueError on the ranks concerned, no hang.
- Ordering and liveness faults: nested gathers, threads on two groups, a late rank, a
  sender resumed after its first rank gave up, the store host gone.
- Re-initialisation of the default process group (twice, with swapped rank numbers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import gc
import logging
import os
import re
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from distribute_utils import (
    PeerLostError,
    ProcessGroupMesh,
    barrier,
    get_configs_parallel,
    get_tensors_parallel,
    incarnation,
    liveness,
    sync,
)
from distribute_utils.transports import carriers, shm

from harness import RankPool, job_store, load_script, remake_group, shm_entries

SIZES = {"inline": 16, "shm": 300_000}  # elements: inside the claim, or through /dev/shm


def _layer(rank: int, layer: int, n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + layer)
    return {"layer": layer, "rank": rank, "w": torch.randn(n, generator=g).to(torch.bfloat16), "s": None}


def _modelopt_tp_pp(workspace: str | None, n: int) -> dict[str, Any]:
    """TP2 x PP2 on 4 ranks, laid out [pp, tp] as ModelOpt assumes; its call pattern exactly."""
    rank, world, tp = dist.get_rank(), dist.get_world_size(), 2
    tp_rank, pp_rank = rank % tp, rank // tp
    layers = [_layer(rank, i, n) for i in range(3)]
    # PP merge: group=None (the whole world) while each pipeline group passes its own ranks.
    pp_ranks = list(range(tp_rank, world, tp))
    merged: list[Any] = []
    for layer in layers:
        with get_configs_parallel(layer, pp_ranks, None, workspace_path=workspace, timeout=60) as got:
            merged.extend(got)
    out: dict[str, Any] = {"pp": [(c["rank"], c["layer"]) for c in merged], "tp": None}
    if merged:
        out["pp_bytes_ok"] = all(torch.equal(c["w"], _layer(c["rank"], c["layer"], n)["w"]) for c in merged)
    if pp_rank != 0:
        return out
    # TP merge: only pp_rank 0 ranks, synchronising on their own group (a rank list here: a torch
    # group made by two of four ranks needs every rank's help in torch).
    tp_group = [0, 1]
    weight = torch.full((4, n), float(rank))
    with get_tensors_parallel(weight, [0, 1], tp_group, timeout=60) as shards:
        if shards:
            out["tp"] = torch.equal(
                torch.cat(shards), torch.cat([torch.full((4, n), 0.0), torch.full((4, n), 1.0)])
            )
            out["tp_devices"] = sorted({str(s.device) for s in shards})
    return out


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("where", ["shm", "workspace"])
def test_modelopt_tp_pp_pattern(ranks4: RankPool, tmp_path: Any, where: str, size: str) -> None:
    workspace = str(tmp_path / "ws") if where == "workspace" else None
    results = ranks4.run(_modelopt_tp_pp, workspace, SIZES[size])
    # Ranks 0 and 1 each receive their pipeline group's layers: own first, then the other stage's.
    assert results[0]["pp"] == [(0, 0), (2, 0), (0, 1), (2, 1), (0, 2), (2, 2)]
    assert results[1]["pp"] == [(1, 0), (3, 0), (1, 1), (3, 1), (1, 2), (3, 2)]
    assert results[2]["pp"] == results[3]["pp"] == []
    assert results[0]["pp_bytes_ok"] and results[1]["pp_bytes_ok"]
    assert results[0]["tp"] is True and results[0]["tp_devices"] == ["cpu"]
    assert results[1]["tp"] is None


def _overlapping(case: str, workspace: str | None) -> dict[str, Any]:
    """The four cases' gather, through the mailboxes, or through the store (``workspace``: its files)."""
    rank = dist.get_rank()
    how: dict[str, Any] = {"transport": "workspace", "workspace_path": workspace} if workspace else {}
    lists = {
        # rank 1 names [0, 1] but rank 0 passes [0, 1, 2]; rank 3 is in its own list.
        "superset": {0: [0, 1, 2], 1: [0, 1], 2: [0, 1, 2], 3: [3, 2]},
        # two firsts name each other: [0, 1] vs [1, 0]
        "crossed": {0: [0, 1], 1: [1, 0], 2: [2, 3], 3: [2, 3]},
        # a sender names as first a rank that only sends elsewhere
        "first_is_sender": {0: [0, 1], 1: [0, 1], 2: [1, 2], 3: [3]},
        # a first names as its sender the first of another list, which ends at once
        "sender_is_a_first": {0: [0, 1], 1: [0, 1], 2: [2, 0], 3: [3]},
    }[case]
    start = time.monotonic()
    try:
        with get_tensors_parallel(torch.full((3,), float(rank)), lists[rank], timeout=60, **how) as got:
            result = {"got": [t.tolist() for t in got]}
    except Exception as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["seconds"] = time.monotonic() - start
    # A rank whose own gather succeeded while another named it in a list it did not pass fails its next
    # gather, naming that (and so do that gather's partners): what the next one of all four says.
    dist.barrier()
    try:
        with get_tensors_parallel(torch.ones(1), [0, 1, 2, 3], timeout=60):
            result["next"] = "ok"
    except ValueError as exc:
        result["next"] = str(exc)
    # Every claim and verdict key is collected after a barrier, also one the watchdog posted in a place.
    barrier(timeout=30)
    assert liveness.JANITOR.drain(30)
    dist.barrier()
    result["left"] = _keys_of(None)
    return result


@pytest.mark.parametrize("round_", ["direct", "store"])
@pytest.mark.parametrize("case", ["superset", "crossed", "first_is_sender", "sender_is_a_first"])
def test_overlapping_lists_raise_on_the_ranks_concerned_without_hanging(
    ranks4: RankPool, tmp_path: Path, case: str, round_: str
) -> None:
    """In a store round no sender posts a verdict key: a rank that takes a sender for its first rank
    ("first_is_sender": rank 2 waits on rank 1) hears it from the watchdog, which reads that rank's claim."""
    results = ranks4.run(_overlapping, case, str(tmp_path) if round_ == "store" else None)
    for rank, r in enumerate(results):
        assert r["seconds"] < 30, f"rank {rank} waited {r['seconds']:.1f} s: {r}"
        assert r["left"] == 0, f"rank {rank}: {r['left']} claim or verdict keys left after a barrier"
    errors = {rank: r for rank, r in enumerate(results) if "error" in r}
    if case == "superset":
        assert set(errors) >= {0, 1, 2}, results
        assert errors[1]["error"] == "ArgumentError" and "[0, 1, 2]" in errors[1]["message"], errors[1]
    if case == "crossed":
        assert set(errors) == {0, 1}, results
        assert all(e["error"] == "ArgumentError" and "[1, 0]" in e["message"] for e in errors.values()), (
            errors
        )
        assert results[2]["got"] == [[2.0] * 3, [3.0] * 3]  # the disjoint gather is untouched
    if case in ("first_is_sender", "sender_is_a_first"):
        assert errors[2]["error"] == "ArgumentError" and "[0, 1]" in errors[2]["message"], errors[2]
        # (through the store, rank 2 hears from the watchdog's stand-in: its first look comes after 1 s)
        assert errors[2]["seconds"] < 10, errors[2]
        assert results[0].get("got") == [[0.0] * 3, [1.0] * 3], results
    for r in errors.values():
        assert "disagree" in r["message"] or "cannot take part" in r["message"] or "failed" in r["message"], r
    nexts = [r["next"] for r in results]
    assert nexts == ["ok"] * 4 or all("ranks disagree on a gather" in n for n in nexts), nexts
    if round_ == "direct" and case in ("first_is_sender", "sender_is_a_first"):
        # A rank that succeeded was named elsewhere: it hears so when asked, which only a direct round does.
        assert all("ranks disagree on a gather" in n for n in nexts), nexts


def _nested(n: int) -> list[Any]:
    rank = dist.get_rank()
    seen = []
    with get_tensors_parallel(torch.full((n,), float(rank)), [0, 1, 2, 3], timeout=20) as outer:
        with get_tensors_parallel(torch.full((n,), 10.0 + rank), [3, 2, 1, 0], timeout=20) as inner:
            seen = [float(t[0]) for t in outer] + [float(t[0]) for t in inner]
        with get_configs_parallel({"r": rank}, [1, 0, 2, 3], timeout=20) as third:
            seen += [c["r"] for c in third]
    barrier(timeout=20)
    return seen


@pytest.mark.parametrize("n", [8, 100_000])
def test_nested_gathers(ranks4: RankPool, n: int) -> None:
    start = time.monotonic()
    results = ranks4.run(_nested, n, timeout=60)
    assert time.monotonic() - start < 30
    assert results[0] == [0.0, 1.0, 2.0, 3.0]
    assert results[3] == [13.0, 12.0, 11.0, 10.0]
    assert results[1] == [1, 0, 2, 3]
    assert results[2] == []


def _two_threads() -> dict[str, Any]:
    """Each rank gathers along tp and pp at once, from two threads (a 2 x 2 mesh)."""
    rank = dist.get_rank()
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    out: dict[str, Any] = {}
    failures: list[BaseException] = []

    def along(axis: str) -> None:
        try:
            ranks = mesh.ranks_along_axis(axis)
            for i in range(20):
                with get_tensors_parallel(
                    torch.full((4,), rank * 100.0 + i), ranks, ranks, timeout=20
                ) as got:
                    if got:
                        out.setdefault(axis, []).append([float(t[0]) for t in got])
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=along, args=(a,)) for a in ("tp", "pp")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if failures:
        raise failures[0]
    return out


def test_two_threads_gather_on_different_groups(ranks4: RankPool) -> None:
    results = ranks4.run(_two_threads, timeout=90)
    assert results[0]["tp"][5] == [5.0, 105.0] and results[0]["pp"][5] == [5.0, 205.0]
    assert results[1]["pp"][19] == [119.0, 319.0]
    assert results[2]["tp"][0] == [200.0, 300.0]
    assert "tp" not in results[1] and results[3] == {}


def _late_first_meeting(victim: int) -> dict[str, Any]:
    """``victim`` is stopped past the timeout at a group's first gather, then resumed."""
    rank = dist.get_rank()
    ranks = [0, 1, 2, 3]
    outcome: dict[str, Any] = {}
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes it after the others gave up
    try:
        with get_tensors_parallel(torch.full((5,), float(rank)), ranks, timeout=3) as got:
            outcome["first"] = len(got)
    except Exception as exc:
        outcome["first"] = type(exc).__name__
    # Every later gather works: the group is not broken for good.
    barrier(timeout=60)
    for i in range(3):
        with get_tensors_parallel(torch.full((5,), float(rank + i)), ranks, timeout=60) as got:
            if got:
                outcome.setdefault("later", []).append([float(t[0]) for t in got])
    return outcome


def _run_with_a_stopped_rank(pool: RankPool, victim: int, fn: Any, *args: Any) -> list[Any]:
    """Run ``fn`` while ``victim`` stops itself (SIGSTOP); resume it well past the others' timeout."""
    pid = pool.pids[victim]
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(pool.run(fn, *args, timeout=120)))
    runner.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the victim shows as stopped ("T")
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.05)
    time.sleep(5)  # the others' timeout is 3 s
    os.kill(pid, signal.SIGCONT)
    runner.join(120)
    return done[0]


def test_a_late_rank_at_the_first_meeting_does_not_break_the_group(ranks4: RankPool) -> None:
    results = _run_with_a_stopped_rank(ranks4, 2, _late_first_meeting, 2)
    assert results[0]["first"] == "PeerLostError"
    assert results[2]["first"] in ("PeerLostError", "GatherError"), results[2]
    assert results[0]["later"] == [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0]]


def _claim_fails_on_rank_2(transport: str) -> dict[str, Any]:
    """Rank 2 fails once it has published its payload, before its claim goes (a fault injected at the
    carriers' "published" point; the collective's, once its receipt is made): everybody hears it at once."""
    rank = dist.get_rank()

    def broken(point: str, sender: int, carrier: Any, receipt: Any) -> None:
        if point == "published":
            raise RuntimeError("no notes today")

    kept = carriers.inject(broken if rank == 2 else None)
    start = time.monotonic()
    try:
        with get_tensors_parallel(
            torch.full((300_000,), float(rank)), [0, 1, 2, 3], timeout=60, transport=transport
        ):
            outcome: dict[str, Any] = {"error": None}
    except Exception as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        carriers.inject(kept)
    outcome["seconds"] = time.monotonic() - start
    with get_tensors_parallel(torch.full((300_000,), float(rank)), [0, 1, 2, 3], timeout=60) as got:
        outcome["after"] = [float(t[0]) for t in got]
    return outcome


@pytest.mark.parametrize("transport", ["auto", "collective"])
def test_a_sender_whose_claim_cannot_be_built_tells_everyone_at_once(
    ranks4: RankPool, transport: str
) -> None:
    results = ranks4.run(_claim_fails_on_rank_2, transport)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "no notes today" in r["error"], (rank, r)
        assert r["seconds"] < 30, (rank, r)  # the first rank did not wait for a claim that never came
    assert "rank 2" in results[0]["error"], results[0]
    assert results[0]["after"] == [0.0, 1.0, 2.0, 3.0]
    assert shm_entries(set(ranks4.pids)) == set(), "the job's ranks left segments"


def _wait_for_key(group: sync.GroupSync, key: str) -> bool:
    deadline = time.monotonic() + 30
    while group.read(key) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return group.read(key) is not None


def _sender_outwaits_its_timeout(workspace: str | None, tag: str) -> dict[str, Any]:
    """Rank 1 (timeout 2 s) waits for rank 0, which is there but waits for rank 2 (3 s late)."""
    rank, group = dist.get_rank(), sync.companion(None)
    barrier(timeout=60)
    entering = f"{group.namespace}/test/{tag}/rank-1-enters"  # (a key of this run only)
    if rank == 1:
        group.store.set(entering, b"1")
    if rank in (0, 2):
        _wait_for_key(group, entering)
    if rank == 2:
        time.sleep(3.0)  # past rank 1's timeout, well within a second one
    start = time.monotonic()
    transport = "auto" if workspace is None else "workspace"
    try:
        timeout = 2 if rank == 1 else 60
        with get_tensors_parallel(
            torch.full((4,), float(rank)),
            [0, 1, 2],
            timeout=timeout,
            transport=transport,
            workspace_path=workspace,
        ) as got:
            outcome: dict[str, Any] = {"got": [float(t[0]) for t in got]}
    except Exception as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome["seconds"] = time.monotonic() - start
    return outcome


@pytest.mark.parametrize("path", ["direct", "store"])
def test_a_sender_past_its_timeout_waits_again_for_a_first_rank_that_is_there(
    ranks4: RankPool, tmp_path: Any, path: str
) -> None:
    """Direct: rank 0 answers rank 1's inquiry that it is in the call; store: its claim says so. Either
    way rank 1 takes a second timeout instead of failing."""
    workspace = None if path == "direct" else str(tmp_path / "ws")
    results = ranks4.run(
        _sender_outwaits_its_timeout, workspace, f"{path}-{os.getpid()}-{time.monotonic_ns()}"
    )
    assert "error" not in results[1] and results[1]["seconds"] > 2, results[1]
    assert results[0]["got"] == [0.0, 1.0, 2.0], results[0]
    assert results[3] == {"got": [], "seconds": results[3]["seconds"]}


def _sender_after_first_gave_up() -> dict[str, Any]:
    """The first rank gives up on rank 3 (stopped); rank 3 resumes and hears why at once."""
    rank = dist.get_rank()
    if rank == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        with get_tensors_parallel(torch.zeros(200_000), [0, 1, 2, 3], timeout=3):
            pass
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    barrier(timeout=60)
    with get_tensors_parallel(torch.full((200_000,), float(rank)), [0, 1, 2, 3], timeout=60) as got:
        ok = [float(t[0]) for t in got]
    return {"error": error, "elapsed": elapsed, "after": ok}


def test_sender_resumed_after_the_first_gave_up_hears_why(ranks4: RankPool) -> None:
    results = _run_with_a_stopped_rank(ranks4, 3, _sender_after_first_gave_up)
    assert "did not arrive" in results[0]["error"] and "[3]" in results[0]["error"]
    # The resumed sender finds the verdict at once instead of waiting for a timeout.
    assert results[3]["error"] is not None and results[3]["elapsed"] < 2.5, results[3]
    assert results[0]["after"] == [0.0, 1.0, 2.0, 3.0]


def _reinit(swapped: list[int], workspace: str, tag: str) -> dict[str, Any]:
    """Destroy the default group and make it again with swapped rank numbers, then back; use
    barriers, gathers over shm and the workspace, and a mesh in every incarnation."""
    store = job_store()
    host, port, world = store.host, store.port, dist.get_world_size()
    old_rank = dist.get_rank()
    seen: dict[str, Any] = {}
    for attempt, rank in enumerate((swapped[old_rank], old_rank)):
        barrier(timeout=30)
        before_rank = dist.get_rank()
        values = torch.full((300_000,), float(before_rank))
        with get_tensors_parallel(values, list(range(world)), timeout=30) as got:
            before = [float(t[0]) for t in got]
        dist.destroy_process_group()
        client = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
        # torch itself needs a fresh prefix to re-initialise on one store (its gloo rendezvous
        # keys go stale otherwise), as torchrun's elastic restarts do.
        base = dist.PrefixStore(f"reinit/{tag}/{attempt}", client)
        dist.init_process_group("gloo", store=base, rank=rank, world_size=world)
        barrier(timeout=30)
        mesh = ProcessGroupMesh(world // 2, 2, axis_names=("pp", "tp"))
        results = []
        for path in (None, workspace):
            with get_tensors_parallel(
                torch.full((300_000,), 100.0 + rank), list(range(world)), workspace_path=path, timeout=30
            ) as got:
                results.append([float(t[0]) for t in got])
            with get_configs_parallel({"rank": rank}, mesh.ranks_along_axis("tp"), timeout=30) as got:
                results.append([c["rank"] for c in got])
        mesh.barrier("tp", timeout=30)
        seen[f"attempt{attempt}"] = {
            "before": before,
            "before_rank": before_rank,
            "after": results,
            "rank": dist.get_rank(),
        }
    return seen


@pytest.mark.parametrize("world", [pytest.param(4, marks=pytest.mark.slow), 2])
def test_reinitialisation_twice_with_swapped_ranks(pools: Any, tmp_path: Any, world: int) -> None:
    swapped = [1, 0, 3, 2][:world]
    tag = f"{os.getpid()}-{time.monotonic_ns()}"  # one fresh prefix per attempt, the same on every rank
    results = pools.get(world).run(_reinit, swapped, str(tmp_path / "ws"), tag, timeout=120)
    expected = [100.0 + r for r in range(world)]
    for attempt, numbering in enumerate((swapped, list(range(world)))):
        by_rank = {r[f"attempt{attempt}"]["rank"]: r[f"attempt{attempt}"] for r in results}
        assert [by_rank[r]["rank"] for r in range(world)] == list(range(world))
        assert [results[p][f"attempt{attempt}"]["rank"] for p in range(world)] == numbering
        assert by_rank[0]["after"] == [expected, [0, 1], expected, [0, 1]]
        assert by_rank[1]["after"] == [[], [], [], []]
        if world == 4:
            assert by_rank[2]["after"] == [[], [2, 3], [], [2, 3]]
        first_before = [r[f"attempt{attempt}"] for r in results if r[f"attempt{attempt}"]["before_rank"] == 0]
        assert first_before[0]["before"] == [float(r) for r in range(world)]


def _pool_reports(how: str, tag: str) -> dict[str, Any]:
    """Senders publish pooled segments to rank 0, which lets them go; before a verdict carries the
    report, either the group is made anew with ranks 1 and 2 swapped (``renumbered``), or rank 0 sends
    the reports in its claim to a gather that fails before its first rank reads the claims
    (``failed``; ``failed-collective``: the senders hear it from the first rank's "go", not from a
    verdict). A small gather afterwards must reach the processes that sent the segments."""
    world, old = dist.get_world_size(), dist.get_rank()
    with get_tensors_parallel(torch.full((300_000,), float(old)), list(range(world)), timeout=30) as got:
        values = [float(t[0]) for t in got]
    del got
    gc.collect()  # the first rank's views are gone: it holds one report per sender
    busy = shm.pooled_bytes()[0]  # segments in this process's pool
    if how == "renumbered":
        remake_group([0, 2, 1, 3][old], f"pool-reports/{tag}/0")
        barrier(timeout=30)  # every rank has posted where it runs
    else:
        # Rank 3 receives and gives up at once (a non-tensor of its own): it never reads rank 0's claim.
        value: Any = "not a tensor" if old == 3 else torch.zeros(4)
        with (
            pytest.raises(TypeError, match=r"gathers a torch\.Tensor"),
            get_tensors_parallel(
                value,
                [3, 0, 1, 2],
                transport="collective" if how == "failed-collective" else "auto",
                timeout=30,
            ),
        ):
            pass
    with get_configs_parallel({"rank": dist.get_rank()}, list(range(world)), timeout=30) as got:
        ranks = [c["rank"] for c in got]
    held = shm.pooled_bytes()  # what was free went back with the old group; the rest when reported
    if how == "renumbered":
        remake_group(old, f"pool-reports/{tag}/1")
        barrier(timeout=30)
    else:
        shm.release_shared_memory()
        held = shm.pooled_bytes()
    return {"values": values, "busy": busy, "ranks": ranks, "held": held}


@pytest.mark.parametrize("how", ["renumbered", "failed", "failed-collective"])
def test_pool_reports_reach_the_sending_process(ranks4: RankPool, how: str) -> None:
    """Reports name processes: made under one numbering and delivered under another, they reach the
    process that holds the segment (before: rank 1's report went to the process that now was rank 1,
    which ignored it). Reports in a claim that a failed gather never read are kept for the next
    gather (before: lost). Either way a sender's segment stayed allocated and busy for good."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    results = ranks4.run(_pool_reports, how, tag, timeout=120)
    assert results[0]["values"] == [0.0, 1.0, 2.0, 3.0]
    # (a segment of an earlier test may still be in a sender's pool, its report on the way)
    assert all(r["busy"] >= 1 for r in results[1:]), "each sender published through a pooled segment"
    assert results[0]["ranks"] == [0, 1, 2, 3]
    assert [r["held"] for r in results] == [(0, 0)] * 4, "a sender still holds a segment nobody maps"


def test_a_new_incarnation_on_the_same_store_never_reads_the_old_keys() -> None:
    """Re-made on the very same store, the default group gets a new generation: the keys the
    old one left (not collected: the process may have crashed) are never read again."""
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    namespaces, results, left, stale = [], [], [], []
    try:
        for _ in range(2):
            dist.init_process_group("gloo", store=master, rank=0, world_size=1)
            barrier(timeout=10)
            with get_configs_parallel({"a": len(namespaces)}, [0], timeout=10) as got:
                results.append(got[0]["a"])
            namespaces.append(sync.companion(None).namespace)
            if not stale:
                stale.append(sync.companion(None).arrival_key(0))  # the first incarnation's barrier key
            left.append(bool(dist.distributed_c10d._get_default_store().check(stale)))
            dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert results == [0, 1]
    assert namespaces[0] != namespaces[1] and "/g1/" in namespaces[0] and "/g2/" in namespaces[1]
    assert left == [True, True], "the old incarnation's keys are still there, unread"


def test_store_host_gone_is_a_peer_lost_error() -> None:
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    # Connect with a long timeout (a new connection can stall 5 s on this machine's resolver, see
    # docs/performance.md), then wait with a short one.
    client = dist.TCPStore(
        "127.0.0.1", master.port, 1, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    client.set_timeout(datetime.timedelta(seconds=5))
    group = sync.GroupSync((0, 1), 0, client, "test/store-gone")
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            group.barrier(30, what="barrier over ranks [0, 1]")
        except BaseException as exc:
            failure.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)  # rank 1 never comes; the store's host goes away meanwhile
    del master
    waiter.join(40)
    assert failure and isinstance(failure[0], PeerLostError), failure
    assert "rendezvous store" in str(failure[0]) or "did not arrive" in str(failure[0])


def _barrier_ranks(store_port: int, n: int, rounds: list[tuple[int, ...]]) -> list[list[Any]]:
    """``n`` ranks of one group, threads with a store client each, entering barrier after barrier: the
    ranks of ``rounds[i]`` enter the i-th (timeout 1 s). Each rank's outcome per barrier: "ok" or the
    missing ranks its error named."""
    outcomes: list[list[Any]] = [[] for _ in range(n)]

    def rank(r: int) -> None:
        client = dist.TCPStore(
            "127.0.0.1", store_port, 1, is_master=False, timeout=datetime.timedelta(seconds=60)
        )
        group = sync.GroupSync(tuple(range(n)), r, client, "test/arrivals")
        for entering in rounds:
            if r not in entering:
                break
            try:
                group.barrier(1.0)
                outcomes[r].append("ok")
            except PeerLostError as exc:
                outcomes[r].append(tuple(exc.missing))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


def test_a_barrier_names_the_rank_that_entered_earlier_barriers_but_not_this_one() -> None:
    """A rank's arrival is one key for the group's life, overwritten with the barrier's number: a rank that
    entered the earlier barriers but not this one is named late (its key holds an earlier number), and
    the ranks that entered are not."""
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    outcomes = _barrier_ranks(master.port, 3, [(0, 1, 2)] * 3 + [(0, 1)])
    assert outcomes[2] == ["ok"] * 3
    assert outcomes[0] == outcomes[1] == ["ok"] * 3 + [(2,)], outcomes


def test_the_janitor_deletes_no_key_per_rank_per_barrier() -> None:
    """Barriers make no key per rank that must be deleted (each rank overwrites its one arrival key): the
    janitor's deletions per barrier are the first rank's two (the counter and the key waited on), not
    one per rank (``scripts/bench_sync_scale.py``'s counted store; its background client is the
    janitor's and the watchdog's)."""
    bench = load_script("bench_sync_scale")
    report = bench.run_scale([8], repeats=3, kinds=("our_barrier",), store="hash")
    # The background client is the watchdog's too: a wait past its grace reads up to one key per rank.
    # The janitor's two per barrier are 1.25 per rank here; one per rank per barrier (the old layout) 3.75.
    assert report[8]["background_keys_per_rank"] <= 2.5, report[8]


def test_store_keys_per_round_a_sender_constant_the_first_rank_linear() -> None:
    """The real round on simulated ranks (scripts/bench_sync_scale.py: threads, each with its own peer
    directory and companion, running gather.gather_on through the store channel; an in-process store,
    every key of every operation counted per rank) at N = 8 and 64. A sender's keys per round are the
    same at every N, its first call included (it reads its first rank's info, not every rank's), and in
    steady calls two: its claim and the verdict (no key stands for a verdict it never gives); the first
    rank's grow by one or two per participant (their claims; on the first call their infos)."""
    bench = load_script("bench_sync_scale")
    report = bench.run_scale([8, 64], repeats=1, kinds=("our_barrier", "tiny_gather"), store="hash")
    for phase in ("first", "steady"):
        small, large = (report[n][f"tiny_gather/{phase}"] for n in (8, 64))
        most = 4 if phase == "first" else 2
        assert small["other_keys"] == large["other_keys"] <= most, (phase, small, large)
        slope = (large["first_keys"] - small["first_keys"]) / (64 - 8)
        assert 1 <= slope <= 2 and large["first_keys"] <= 2 * 64 + 2, (phase, small, large)
        for n in (8, 64):
            barrier = report[n][f"our_barrier/{phase}"]
            assert barrier["first_keys"] <= 4 and barrier["other_keys"] <= 4, (n, phase, barrier)


def test_the_janitor_never_connects_to_a_store_that_is_gone_or_dropped() -> None:
    """A store whose server went away (a test's, a dead job's) would make a new client retry for the
    store's whole timeout, and hold the process at exit: the janitor deletes nothing there instead."""
    janitor = liveness.Janitor()
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.PrefixStore("p/", dist.TCPStore("127.0.0.1", master.port, 1, is_master=False))
    client.set("k", b"1")
    janitor.delete_now(weakref.ref(client), ["k"])
    assert not client.check(["k"]), "deleted while the server answers, on a client of its own"
    assert janitor.clients == 1
    other = dist.PrefixStore("q/", dist.TCPStore("127.0.0.1", master.port, 1, is_master=False))
    other.set_timeout(datetime.timedelta(seconds=60))
    del master
    start = time.monotonic()
    janitor.delete_now(weakref.ref(other), ["k"])
    assert time.monotonic() - start < 30, "tried to connect to a server that is gone"
    assert janitor.clients == 1, "no client for a store whose server is gone"

    class Recording:
        cloned = 0

        def clone(self) -> Any:
            Recording.cloned += 1
            return self

    dropped = Recording()
    ref = weakref.ref(dropped)
    del dropped
    janitor.delete_now(ref, ["k"])  # queued before the job dropped it
    assert Recording.cloned == 0
    held = Recording()
    janitor.delete(held, [])  # nothing to delete: no thread, no reference kept
    assert not janitor.running
    janitor.stop()


# -- the direct round (one host: claims and verdicts through the ranks' mailboxes) -----------------
def _keys_of(group: list[int] | None) -> int:
    """How many claims and verdicts (``<namespace>/<call>/c|v/<rank>``) the store holds in
    ``group``'s namespace (keys of other groups, and the barriers' own, come and go)."""
    found = re.compile(re.escape(sync.companion(group).namespace) + r"/\d+/[cv]/\d+")
    return sum(bool(found.fullmatch(k)) for k in dist.distributed_c10d._get_default_store().list_keys())


def _keys_per_call(transport: str, n: int) -> dict[str, Any]:
    """``n`` gathers on a fresh group, and how many keys the store gained meanwhile."""
    rank = dist.get_rank()
    group = [3, 2, 1, 0]  # a group of its own: its call counter starts at 0, no collecting barrier
    before = _keys_of(group)  # (before the barrier: no rank posts a key of the gathers until all passed it)
    barrier(group, timeout=30)
    got: list[Any] = []
    for i in range(n):
        # 96 KiB travels inside a direct round's claim (it would go through /dev/shm in a store round)
        value = torch.full((24 * 1024,), float(10 * rank + i))
        with get_tensors_parallel(value, [0, 1, 2, 3], group, transport=transport, timeout=30) as out:
            got.append([float(t[0]) for t in out])
    after = _keys_of(group)
    barrier(group, timeout=30)
    return {"added": after - before, "got": got}


@pytest.mark.parametrize("transport", ["auto", "collective"])
def test_a_gather_within_one_host_leaves_the_store_alone(ranks4: RankPool, transport: str) -> None:
    """Direct round: not one key per call (a store round posts a claim per rank and a verdict)."""
    results = ranks4.run(_keys_per_call, transport, 20)
    assert results[0]["got"] == [[float(10 * r + i) for r in range(4)] for i in range(20)]
    added = [r["added"] for r in results]  # every rank saw the same store
    if transport == "auto":
        assert added == [0] * 4, results
    else:
        assert added == [20 * (4 + 1)] * 4, results


def _one_rank_cannot_listen() -> dict[str, Any]:
    """Rank 2 cannot open sockets for direct messages: gathers with it go through the store, the
    others still go direct; every value arrives exactly."""
    from distribute_utils import mailbox

    rank = dist.get_rank()
    if rank == 2:

        def refuse(point: str, what: str) -> None:
            if point == "listen":
                raise PermissionError(errno.EACCES, "refused by the test")

        mailbox.inject(refuse)
    out: dict[str, Any] = {}
    for name, ranks in (("all", [0, 1, 2, 3]), ("pair", [0, 1])):
        barrier(timeout=30)
        if rank in ranks:
            before = _keys_of(ranks)
            with get_tensors_parallel(torch.full((8,), float(rank)), ranks, ranks, timeout=30) as got:
                out[name] = [float(t[0]) for t in got]
            out[f"{name}_added"] = _keys_of(ranks) - before
    barrier(timeout=30)
    return out


def test_a_rank_that_cannot_listen_takes_part_through_the_store() -> None:
    from distribute_utils.launch import run_local

    results = run_local(_one_rank_cannot_listen, 4, timeout=120)
    assert results[0]["all"] == [0.0, 1.0, 2.0, 3.0] and results[0]["pair"] == [0.0, 1.0]
    assert results[0]["all_added"] > 0  # a list with rank 2 in it: claims in the store
    assert results[0]["pair_added"] == 0  # ranks 0 and 1 alone: direct


def _first_rank_comes_late(delay: float) -> dict[str, Any]:
    """On a fresh group the first rank opens its mailbox only when it enters: the senders' claims
    find nobody listening; in the next gather (11 senders) its queue full (net.unix.max_dgram_qlen
    is 10 by default). They send again until it takes them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = list(range(world))[::-1]  # a group of its own, never used before in this process
    barrier(timeout=60)
    if rank == 0:
        time.sleep(delay)
    start = time.monotonic()
    with get_tensors_parallel(torch.full((1000,), float(rank)), list(range(world)), group, timeout=60) as got:
        values = [float(t[0]) for t in got]
    if rank == 0:  # now it listens, but does not read: the 11th claim finds its queue full
        time.sleep(delay)
    with get_tensors_parallel(torch.full((10,), float(rank)), list(range(world)), group, timeout=60) as got:
        again = [float(t[-1]) for t in got]
    return {"values": values, "again": again, "seconds": time.monotonic() - start}


def test_senders_that_come_before_their_first_rank_listens_are_taken() -> None:
    from distribute_utils.launch import run_local

    results = run_local(_first_rank_comes_late, 12, 0.5, timeout=180)
    assert results[0]["values"] == [float(r) for r in range(12)]
    assert results[0]["again"] == [float(r) for r in range(12)]
    assert all(r["seconds"] < 30 for r in results), results


def _gather_outcome(rank: int) -> dict[str, Any]:
    """One gather of every rank's 4 floats to rank 0 (30 s timeout): its error, if any, and its seconds."""
    start = time.monotonic()
    try:
        with get_tensors_parallel(torch.full((4,), float(rank)), [0, 1, 2, 3], timeout=30):
            pass
        outcome: dict[str, Any] = {"error": None}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    return outcome


def _one_rank_decides_otherwise() -> dict[str, Any]:
    """Rank 2 takes the store round while the others take the direct one (as a rank whose view of
    where ranks run differed would): both sides must hear of it from the other and raise."""
    rank = dist.get_rank()
    if rank == 2:
        sync.GroupSync.direct = lambda self, ranks, timeout, what: False  # type: ignore[method-assign]
    barrier(timeout=60)  # the group's store connections are made (one may stall 5 s: performance.md)
    outcome = _gather_outcome(rank)
    with get_configs_parallel({"rank": rank}, [0, 1, 3], timeout=30) as got:  # the others go on
        outcome["after"] = [c["rank"] for c in got]
    return outcome


def test_a_rank_in_the_store_round_while_the_others_go_direct_fails_everyone_quickly() -> None:
    from distribute_utils.launch import run_local

    results = run_local(_one_rank_decides_otherwise, 4, timeout=120)
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["seconds"] < 10, (rank, r)
        assert "through the store" in r["message"], (rank, r)
    assert results[0]["after"] == [0, 1, 3]


def _a_malformed_claim() -> dict[str, Any]:
    """Rank 1's direct claim message is one byte (a bug, or a message not made by this code)."""
    rank = dist.get_rank()
    if rank == 1:
        send = sync.Call.send_direct

        def garbled(self: sync.Call, to: int, kind: int, parts: Any, timeout: float = 0.0) -> bool:
            return send(self, to, kind, [b"\x01"] if kind == 0 else parts, timeout)

        sync.Call.send_direct = garbled  # type: ignore[method-assign]
    barrier(timeout=60)
    return _gather_outcome(rank)


def test_a_malformed_direct_claim_fails_every_rank_naming_its_sender() -> None:
    from distribute_utils.launch import run_local

    results = run_local(_a_malformed_claim, 4, timeout=120)
    assert results[0]["error"] == "PayloadError" and "rank 1 sent a malformed claim" in results[0]["message"]
    for rank, r in enumerate(results):
        assert "rank 1 sent a malformed claim" in r["message"] and r["seconds"] < 10, (rank, r)


def _reads_each_payload_as_its_claim_comes(elements: int) -> dict[str, Any]:
    """Rank 3 enters only once the first rank has read the payloads of ranks 1 and 2 (it says so in the
    store as it fetches them): the first rank must read each payload as its claim comes, not once every
    claim has come."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:

        def tell(point: str, sender: int, carrier: Any, buffer: Any) -> None:
            if point == "fetched":
                store.set(f"test/decoded/{sender}", b"1")

        carriers.inject(tell)
    barrier(timeout=30)
    if rank == 3:
        store.wait(["test/decoded/1", "test/decoded/2"], datetime.timedelta(seconds=20))
    with get_tensors_parallel(torch.full((elements,), float(rank)), [0, 1, 2, 3], timeout=40) as got:
        return {"values": [float(t[-1]) for t in got]}


@pytest.mark.parametrize("size", ["inline", "shm"])
def test_the_first_rank_reads_each_payload_as_its_claim_comes(size: str) -> None:
    from distribute_utils.launch import run_local

    results = run_local(_reads_each_payload_as_its_claim_comes, 4, SIZES[size], timeout=120)
    assert results[0]["values"] == [0.0, 1.0, 2.0, 3.0]


def _polls_with(cores: int | None) -> dict[str, Any]:
    """A gather of both ranks, this process allowed ``cores`` cores (None: 64, but the ranks on this host
    cannot be counted): do its group's waits poll?"""
    if cores is None:

        def unreadable(self: Any, store: Any) -> int:
            raise RuntimeError("the store cannot be read (the test)")

        incarnation.PeerDirectory.on_this_host = unreadable  # type: ignore[method-assign]
    os.sched_getaffinity = lambda pid: set(range(cores or 64))  # type: ignore[assignment]
    with get_tensors_parallel(torch.full((4,), float(dist.get_rank())), [0, 1], timeout=30) as got:
        values = [float(t[0]) for t in got]
    return {"values": values, "polls": sync.companion(None).mailbox().polls}


@pytest.mark.parametrize(("cores", "polls"), [(2, True), (64, True), (1, False), (None, False)])
def test_waits_poll_before_they_sleep_only_where_each_rank_has_a_core(cores: int | None, polls: bool) -> None:
    from distribute_utils.launch import run_local

    results = run_local(_polls_with, 2, cores, timeout=120)
    assert results[0]["values"] == [0.0, 1.0]
    assert [r["polls"] for r in results] == [polls, polls]


def _a_corrupt_direct_payload(elements: int) -> dict[str, Any]:
    """Rank 1's first payload arrives with a wrong magic number (in its claim, or in its pooled segment; a
    fault injected at the carriers' "fetched" point): the first rank reads it as its claim comes and fails
    the gather at once, on every rank; the next gather works."""
    rank = dist.get_rank()
    if rank == 0:

        def corrupt_once(point: str, sender: int, carrier: Any, buffer: Any) -> Any:
            if point != "fetched" or sender != 1:
                return None
            carriers.inject(None)
            corrupt = bytearray(buffer)
            corrupt[0] ^= 0xFF
            return corrupt

        carriers.inject(corrupt_once)
    barrier(timeout=60)
    start = time.monotonic()
    try:
        with get_tensors_parallel(torch.full((elements,), float(rank)), [0, 1, 2, 3], timeout=30):
            pass
        outcome: dict[str, Any] = {"error": None}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    with get_tensors_parallel(torch.full((elements,), float(rank)), [0, 1, 2, 3], timeout=30) as got:
        outcome["next"] = [float(t[-1]) for t in got]
    return outcome


@pytest.mark.parametrize("size", ["inline", "shm"])
def test_a_corrupt_payload_in_a_direct_round_fails_every_rank_naming_its_sender(size: str) -> None:
    from distribute_utils.launch import run_local

    results = run_local(_a_corrupt_direct_payload, 4, SIZES[size], timeout=120)
    assert results[0]["error"] == "PayloadError", results[0]
    for rank, r in enumerate(results):
        assert "rank 1" in r["message"] and "magic" in r["message"] and r["seconds"] < 10, (rank, r)
    assert results[0]["next"] == [0.0, 1.0, 2.0, 3.0]


def test_a_companion_without_a_directory_waits_without_the_watchdog(caplog: pytest.LogCaptureFixture) -> None:
    """A GroupSync made without a peer directory has no local peers to watch: a barrier on it must not
    hand the watchdog a watch (whose every check failed, logged at debug level only)."""
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(
        "127.0.0.1", master.port, 1, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    group = sync.GroupSync((0, 1), 0, client, "test/no-directory")
    caplog.set_level(logging.DEBUG, logger="distribute_utils")
    with pytest.raises(PeerLostError) as failed:  # rank 1 never comes: the wait outlasts the watchdog's grace
        group.barrier(3, what="barrier over ranks [0, 1]")
    assert failed.value.missing == (1,)
    failures = [r.getMessage() for r in caplog.records if "watchdog check failed" in r.getMessage()]
    assert not failures, f"the watchdog was given a watch it cannot check ({len(failures)} failed checks)"


def test_a_round_of_watchdog_checks_reads_each_source_once_however_many_waits() -> None:
    """Threads of one process waiting on different groups share its peer directory: one round of the
    watchdog's checks reads its local peers once, not once per wait (16 waits here), a wait that ended
    while the round ran is not looked at, and the first read of the peers' infos is one check and one
    multi_get, not two operations per peer (7 here). Store operations and reads of the local peers are
    counted; the round is held inside a read by events, never by time."""
    from distribute_utils.incarnation import PeerDirectory, this_process

    class Ops:
        """An in-process store that counts its operations (a clone is itself: the watch client)."""

        def __init__(self) -> None:
            self.inner, self.count = dist.HashStore(), 0

        def clone(self) -> Ops:
            return self

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.inner, name)

            def counted(*args: Any) -> Any:
                self.count += 1
                return method(*args)

            return counted

    class Source:
        """A peer directory whose reads of the local peers are counted; the first two are held."""

        def __init__(self, directory: PeerDirectory, store: Ops) -> None:
            self.directory, self.store, self.calls, self.first_ops = directory, store, 0, 0
            self.entered = [threading.Event(), threading.Event()]
            self.release = [threading.Event(), threading.Event()]

        def local_peers(self) -> dict[int, Any]:
            self.calls += 1
            before = self.store.count
            peers = self.directory.local_peers()
            if self.calls == 1:
                self.first_ops = self.store.count - before
            if self.calls <= 2:
                self.entered[self.calls - 1].set()
                assert self.release[self.calls - 1].wait(60)
            return peers

    store, me = Ops(), this_process()
    directories = [PeerDirectory(cast(dist.Store, store), "wd", r, me) for r in range(8)]
    busy, other = Source(directories[0], store), Source(directories[1], store)
    dog = liveness.Watchdog()

    def watch(source: Source) -> int:
        w = liveness.Watch(
            cast(PeerDirectory, source), cast(dist.Store, store), {r: f"k/{r}" for r in range(8)}, None
        )
        w.since -= 10 * liveness.GRACE_S  # due at once
        return dog.add(w)

    mine = [watch(busy) for _ in range(16)]
    ended = watch(other)
    try:
        assert busy.entered[0].wait(60), "the watchdog never looked"
        dog.remove(ended)  # its wait ends while the round is inside the busy source's read
        busy.release[0].set()
        assert busy.entered[1].wait(60), "no second round"
        for ident in mine:
            dog.remove(ident)
        busy.release[1].set()
    finally:
        busy.release[0].set(), busy.release[1].set()
        dog.close()
    assert busy.calls == 2, f"{busy.calls} reads of the local peers in two rounds of 16 waits on one source"
    assert other.calls == 0, "a wait that had ended was looked at"
    assert busy.first_ops <= 3, f"{busy.first_ops} store operations to read 7 local peers' infos"
    assert len(directories[0].local_peers()) == 7


def test_a_stand_in_reads_its_source_after_a_second_then_less_often_and_posts_once_it_is_there() -> None:
    """A sender's wait for a verdict names a stand-in (the awaited rank's claim, read by the watchdog):
    the first look comes after a second (a wait that ends sooner costs the store nothing), and while the
    source is not there, each look puts the next further off (up to 8 s: every process of a job may be
    waiting). Once it is there, what stands in is posted where the rank posts nothing (a post that fails
    is tried again the next round), and the waiter is told to collect it. The watchdog's rounds are
    counted through the watch's source, never timed."""
    from distribute_utils.incarnation import PeerDirectory, this_process

    class Store:
        """An in-process store that counts checks and gets (a clone is itself: the watch client)."""

        def __init__(self) -> None:
            self.inner, self.checks, self.gets, self.posts = dist.HashStore(), 0, 0, 0
            self.posted = threading.Event()

        def clone(self) -> Store:
            return self

        def check(self, keys: list[str]) -> bool:
            self.checks += 1
            return self.inner.check(keys)

        def get(self, key: str) -> bytes:
            self.gets += 1
            return self.inner.get(key)

        def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
            self.posts += 1
            if self.posts == 1:
                raise RuntimeError("the store hiccups once")
            found = self.inner.compare_set(key, expected, desired)  # type: ignore[arg-type]
            self.posted.set()
            return found

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    class Rounds:
        """The watch's source: counts the watchdog's rounds (each reads the local peers once)."""

        def __init__(self, directory: PeerDirectory) -> None:
            self.directory, self.count, self.changed = directory, 0, threading.Condition()

        def local_peers(self) -> dict[int, Any]:
            with self.changed:
                self.count += 1
                self.changed.notify_all()
            return self.directory.local_peers()

        def wait_for(self, count: int) -> None:
            with self.changed:
                assert self.changed.wait_for(lambda: self.count >= count, 60), "the watchdog stopped"

    store = Store()
    rounds = Rounds(PeerDirectory(dist.HashStore(), "si", 0, this_process()))  # (its reads not counted)
    before = time.monotonic()
    stand_in = liveness.StandIn("c/1", "v/1", lambda claim: b"stands for " + claim)
    assert stand_in.next_look >= before + liveness.STAND_IN_S, "the first look comes after a second"
    watch = liveness.Watch(cast(PeerDirectory, rounds), cast(dist.Store, store), {1: "v/1"}, None, stand_in)
    watch.since -= 10 * liveness.GRACE_S  # due at once
    stand_in.next_look, stand_in.gap = 0.0, 3600.0  # look now; the next look an hour later
    dog = liveness.Watchdog()
    ident = dog.add(watch)
    try:
        rounds.wait_for(1)
        looked = time.monotonic()
        rounds.wait_for(5)
        assert (store.checks, store.gets) == (1, 0), "a source that is not there was read more than once"
        assert stand_in.next_look >= looked + 3600 - 1, "the next look is not a gap away"
        assert stand_in.gap == 8.0, "the gap doubles up to 8 s"
        store.inner.set("c/1", b"its claim")
        stand_in.next_look = 0.0
        assert store.posted.wait(60), "a post that failed was not tried again"
        assert store.inner.get("v/1") == b"stands for its claim" and store.posts == 2
        assert stand_in.posted and (store.checks, store.gets) == (3, 2)
        count = rounds.count
        rounds.wait_for(count + 3)
        assert (store.checks, store.gets) == (3, 2), "a source was read again once its stand-in was posted"
    finally:
        dog.remove(ident)
        dog.close()


def _a_confused_rank_waits_on_a_sender_that_exits(workspace: str) -> str | None:
    """Store round: rank 2 passes [1, 2] (it takes rank 1, a sender, for its first rank); ranks 0 and 1
    pass [0, 1], rank 3 [3]. Rank 1 exits once its own gather went well. What each rank raised."""
    rank = dist.get_rank()
    ranks = {0: [0, 1], 1: [0, 1], 2: [1, 2], 3: [3]}[rank]
    try:
        with get_tensors_parallel(
            torch.ones(1), ranks, timeout=60, transport="workspace", workspace_path=workspace
        ):
            pass
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if rank == 1:
        os._exit(0)
    return None


def test_a_rank_that_waits_on_a_sender_gone_after_its_gather_hears_that_lists_disagree(
    fresh_job: Any, tmp_path: Path
) -> None:
    """The watchdog finds the awaited rank dead before its stand-in is due, and posts a tombstone in its
    verdict key: the waiter reads the dead rank's claim, which says it did not receive, and raises the
    disagreement (what the marker it no longer posts said), not that the rank exited."""
    results = fresh_job(4).run(
        _a_confused_rank_waits_on_a_sender_that_exits, str(tmp_path), expect_deaths=True
    )
    assert results[0] is None and results[3] is None, results
    assert "ranks disagree on a gather: rank 2 passed ranks=[1, 2], but rank 1" in results[2], results[2]
    assert "passed ranks=[0, 1]" in results[2], results[2]


def test_a_direct_domain_read_from_a_store_that_is_gone_names_the_store() -> None:
    """A sender decides a direct round from its first rank's info (cached) and its domain's list (a store
    read): when the store's server is gone by then, that read fails as every store call does, with a
    PeerLostError naming the store, never a raw network error (seen when rank 0, hosting the store, died)."""
    from distribute_utils.incarnation import PeerDirectory, this_process

    me = this_process()
    if me.direct_domain is None:  # (namespaces unreadable here: the domain's read is what is tested)
        me = dataclasses.replace(me, pid_namespace=1, net_namespace=1)
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    first = PeerDirectory(master, "t", 0, me)
    client = dist.TCPStore(
        "127.0.0.1", master.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    sender = PeerDirectory(client, "t", 1, me)
    assert sender.info(0, client, 10, "test").direct_domain == me.direct_domain  # cached from here on
    del first, master
    gc.collect()
    with pytest.raises(PeerLostError, match="rendezvous store") as caught:
        sender.together([0, 1], client, 10, "deciding the round")
    assert "deciding the round" in str(caught.value)


def test_a_staggered_start_reads_o1_keys_per_sender_to_decide_a_direct_round() -> None:
    """16 ranks of one host come up one after another; each, as soon as it has posted, asks whether the
    16 can talk directly (a sender's question). Each reads O(1) keys, never one per rank not listed yet
    (before: up to 15 reads each, H^2 on the host); every one answers yes. Keys read are counted per
    operation (a multi_get of N keys is N); the ranks' arrival is ordered by events, never by time."""
    from distribute_utils.incarnation import PeerDirectory, this_process

    class Counting:
        """An in-process store that counts the keys each thread reads."""

        def __init__(self) -> None:
            self.inner, self.reads = dist.HashStore(), {}

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.inner, name)
            if name not in ("get", "multi_get"):
                return method

            def counted(*args: Any) -> Any:
                keys = 1 if name == "get" else len(args[0])
                ident = threading.get_ident()
                self.reads[ident] = self.reads.get(ident, 0) + keys
                return method(*args)

            return counted

    me = this_process()
    if me.direct_domain is None:
        me = dataclasses.replace(me, pid_namespace=1, net_namespace=1)
    store, ranks, answers, reads = Counting(), list(range(16)), {}, {}
    PeerDirectory(cast(dist.Store, store), "st", 0, me)  # the first rank is up first
    posted = [threading.Event() for _ in ranks]

    def sender(rank: int) -> None:
        if rank > 1:
            assert posted[rank - 1].wait(60)
        directory = PeerDirectory(cast(dist.Store, store), "st", rank, me)
        posted[rank].set()
        answers[rank] = directory.together(ranks, cast(dist.Store, store), 60, "test")
        reads[rank] = store.reads.get(threading.get_ident(), 0)

    threads = [threading.Thread(target=sender, args=(r,)) for r in ranks[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == {r: True for r in ranks[1:]}, answers
    assert max(reads.values()) <= 4, f"keys read per sender: {reads}"


def test_a_later_record_of_a_call_replaces_the_earlier_one() -> None:
    """A call's record (what a partner of a direct round asks for) is replaced when the call fails after
    recording, never kept twice: the group remembers its last calls, each once."""
    group = sync.GroupSync((0,), 0, cast(dist.Store, dist.HashStore()), "records")
    for number in range(3):
        call = sync.Call(group, number)
        call.record(["send", "ok"])
        call.record(["send", "failed"])
    assert sorted(r[0] for r in group.records if r is not None) == [0, 1, 2], group.records
    assert group.entry(2) == ["send", "failed"] and group.entry(0) == ["send", "failed"]
    assert group.entry(3) is None, "not made yet"
    for number in range(3, 3 + len(group.records)):  # as many calls again: the first ones are forgotten
        sync.Call(group, number).record(["send", "ok"])
    assert group.entry(0) == "past" and group.entry(3) == ["send", "ok"]


def _first_rank_fails_once_the_store_is_gone(fifo: str, workspace: str) -> dict[str, Any]:
    """Rank 0, receiving, waits at the carriers' "fetching" point until the store is gone (the test
    stops it when told through ``fifo``), then fails while reading (a payload error)."""
    from distribute_utils import PayloadError

    rank = dist.get_rank()

    def fail_without_store(point: str, sender: int, carrier: Any, receipt: Any) -> None:
        if point == "fetching":
            with open(fifo, "w") as told:
                told.write("now\n")
            with contextlib.suppress(Exception):  # ends when the store's server does
                job_store().wait(["never posted"], datetime.timedelta(seconds=60))
            with contextlib.suppress(Exception):  # the round's own client finds it gone too
                sync.companion(None).store.check(["never posted"])
            raise PayloadError("planted: the payload is unusable")

    kept = carriers.inject(fail_without_store if rank == 0 else None)
    try:
        with get_tensors_parallel(
            torch.full((1000,), float(rank)),
            [0, 1, 2],
            transport="workspace",
            workspace_path=workspace,
            timeout=30,
        ):
            return {"error": None}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        carriers.inject(kept)


def test_a_first_rank_that_fails_once_the_store_is_gone_says_why_and_removes_what_it_took(
    fresh_job: Any, tmp_path: Path
) -> None:
    """The store's server goes away while the first rank reads, and then the read fails: the first rank
    raises its own error (before, telling its partners through the gone store raised instead, skipping
    what it keeps back and the removal of what senders published for it), and no payload file is left."""
    job = fresh_job(3)
    fifo, workspace = tmp_path / "told", tmp_path / "ws"
    os.mkfifo(fifo)
    workspace.mkdir()

    def stop_when_told() -> None:
        with open(fifo) as told:
            told.read()
        job.stop_store()

    stopper = threading.Thread(target=stop_when_told, daemon=True)
    stopper.start()
    results = job.run(_first_rank_fails_once_the_store_is_gone, str(fifo), str(workspace), timeout=120)
    stopper.join(30)
    assert results[0] == {"error": "PayloadError", "message": "planted: the payload is unusable"}, results[0]
    assert all(r["error"] in ("PeerLostError", "GatherError") for r in results[1:]), results
    files = [p.name for p in workspace.rglob("*") if p.is_file() and p.parent.name.startswith("du-job-")]
    assert [f for f in files if not f.startswith("owner-")] == [], f"payload files left: {files}"
