"""ProcessGroupMesh and barriers on 4 real ranks in a gloo group."""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from distribute_utils import MeshLayout, PeerLostError, ProcessGroupMesh, barrier

from harness import Died, RankPool


def _groups_and_collectives() -> dict:
    mesh = ProcessGroupMesh(1, 2, 2)
    out: dict = {"coord": mesh.coordinate(), "size": mesh.size(), "size1": mesh.size(1)}
    tp = mesh.get_group_along_axis(2)
    pp = mesh.get_group_along_axis(1)
    out["tp"], out["pp"] = mesh.get_ranks_in_group(tp), mesh.get_ranks_in_group(pp)
    t = torch.tensor([mesh.rank])
    dist.all_reduce(t, group=tp)
    out["tp_sum"] = int(t)
    # Cached: the same object on a second request; a different backend gives a different group.
    out["cached"] = mesh.get_group_along_axis(2) is tp
    again = mesh.create_group_along_axis(2)
    out["create_again_cached"] = again is tp
    mesh.destroy_mesh_process_groups()
    mesh.destroy_mesh_process_groups()  # idempotent
    return out


def test_groups_created_cached_and_usable(ranks4: RankPool) -> None:
    results = ranks4.run(_groups_and_collectives)
    assert [r["coord"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [r["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["tp_sum"] for r in results] == [1, 1, 5, 5]
    assert all(r["cached"] and r["create_again_cached"] for r in results)
    assert results[0]["size"] == (1, 2, 2) and results[0]["size1"] == 2


def _cache_keyed_by_backend() -> tuple[bool, str, str]:
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    # The world is gloo, so the default-backend group and an explicit "gloo" request coincide;
    # a request with another backend string must not return the cached one.
    default = mesh.get_group_along_axis("tp")
    gloo = mesh.get_group_along_axis("tp", backend="gloo")
    other = mesh.get_group_along_axis("tp", backend="cpu:gloo")
    result = (default is gloo, dist.get_backend(other), str(other is gloo))
    mesh.destroy_mesh_process_groups()
    return result


def test_group_cache_is_keyed_by_backend(ranks4: RankPool) -> None:
    for same, backend, other_is_gloo in ranks4.run(_cache_keyed_by_backend):
        assert same and other_is_gloo == "False"
        assert "gloo" in backend


def _indices_and_names() -> dict:
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    g = mesh.create_group_along_axis("pp", indices_at_axis=[0, 1])
    return {
        "ranks": mesh.get_ranks_in_group(g) if g is not None else None,
        "coord_tp": mesh.coordinate("tp"),
        "coords": ProcessGroupMesh.get_coords_along_axis((0, 1), 0, [0, 1]),
        "ravel": ProcessGroupMesh.ravel((1, 1), (2, 2)),
        "unravel": ProcessGroupMesh.unravel(3, (2, 2)),
    }


def test_names_indices_and_static_helpers(ranks4: RankPool) -> None:
    results = ranks4.run(_indices_and_names)
    assert [r["ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["coord_tp"] for r in results] == [0, 1, 0, 1]
    assert results[0]["coords"] == [(0, 1), (1, 1)]
    assert results[0]["ravel"] == 3 and results[0]["unravel"] == (1, 1)


def _mesh_errors() -> list[str]:
    messages = []
    for make in (lambda: ProcessGroupMesh(2, 4), lambda: ProcessGroupMesh(2, 2, axis_names=("a", "a"))):
        try:
            make()
        except ValueError as exc:
            messages.append(str(exc))
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    try:
        mesh.get_group_along_axis("ep")
    except KeyError as exc:
        messages.append(str(exc))
    return messages


def test_mesh_errors_name_what_is_valid(ranks4: RankPool) -> None:
    for messages in ranks4.run(_mesh_errors):
        assert "needs a world of at least 8 ranks, but the world size is 4" in messages[0]
        assert "duplicate axis names" in messages[1]
        assert "valid names: ['pp', 'tp']" in messages[2]


def _disagreeing_shapes() -> str:
    shape = (4,) if dist.get_rank() == 2 else (2, 2)
    try:
        ProcessGroupMesh(*shape, timeout=20)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mesh_shapes_that_disagree_raise_everywhere(ranks4: RankPool) -> None:
    for message in ranks4.run(_disagreeing_shapes, timeout=60):
        assert "ranks disagree on the mesh" in message and "rank 2 differs (rank 2 has" in message


def _partial_mesh() -> dict:
    mesh = ProcessGroupMesh(3, rank_offset=1)
    g = mesh.create_group_along_axis(0)
    out: dict = {"member": g is not None}
    try:
        out["coord"] = mesh.coordinate()
    except ValueError as exc:
        out["coord"] = str(exc)
    return out


def test_mesh_inside_a_larger_world(ranks4: RankPool) -> None:
    results = ranks4.run(_partial_mesh)
    assert [r["member"] for r in results] == [False, True, True, True]
    assert "rank 0 is not in" in results[0]["coord"]
    assert [r["coord"] for r in results[1:]] == [(0,), (1,), (2,)]


def _per_axis_barriers() -> bool:
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    store = dist.distributed_c10d._get_default_store()
    barrier(timeout=30)
    call = (store.add("per_axis_barriers", 1) - 1) // 4  # this test's call, the same on every rank
    passed = [f"per_axis_{call}_passed_{r}" for r in (0, 1)]
    # Ranks 2 and 3 (pp=1) reach the tp barrier only after ranks 0 and 1 (pp=0) have passed theirs: if a
    # tp barrier waited for the other tp group, this would deadlock (and fail at the timeout).
    if mesh.coordinate("pp") == 1:
        store.set_timeout(datetime.timedelta(seconds=60))
        store.wait(passed)
    mesh.barrier("tp", timeout=30)
    if mesh.coordinate("pp") == 0:
        store.set(passed[mesh.coordinate("tp")], "1")
    mesh.barrier("pp", timeout=30)
    mesh.barrier(timeout=30)
    barrier(timeout=30)
    return True


def test_barriers_per_axis_let_independent_groups_proceed(ranks4: RankPool) -> None:
    assert ranks4.run(_per_axis_barriers) == [True] * 4


def _world_barrier_rounds(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        barrier(timeout=30)
    return (time.perf_counter() - start) / n


def test_many_barriers_leave_no_keys_behind(ranks4: RankPool) -> None:
    ranks4.run(_world_barrier_rounds, 200)
    before = ranks4.run(_settled_num_keys)[0]
    ranks4.run(_world_barrier_rounds, 300)
    after = ranks4.run(_settled_num_keys)[0]
    assert after - before < 20, (before, after)


def _settled_num_keys() -> int:
    """Keys in the store once the background deletions of finished rounds have caught up."""
    last, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        count = _num_keys()
        if count == last:
            return count
        last = count
        time.sleep(0.2)
    return last


def _num_keys() -> int:
    return dist.distributed_c10d._get_default_store().num_keys()


def _missing_rank_barrier() -> str:
    store = dist.distributed_c10d._get_default_store()
    call = (store.add("missing_rank_barrier", 1) - 1) // 4
    if dist.get_rank() == 3:  # alive, but never arrives: it waits until the others have given up
        store.set_timeout(datetime.timedelta(seconds=60))
        store.wait([f"missing_{call}_gave_up_{r}" for r in range(3)])
        return "late"
    start = time.monotonic()
    try:
        barrier(timeout=1.0)
    except PeerLostError as exc:
        assert isinstance(exc, TimeoutError)
        return f"{time.monotonic() - start:.2f}|{exc.missing}|{exc}"
    finally:
        store.set(f"missing_{call}_gave_up_{dist.get_rank()}", "1")
    return "no error"


def test_missing_rank_is_named_within_timeout(fresh_job) -> None:
    pool = fresh_job(4)
    results = pool.run(_missing_rank_barrier, timeout=60)
    for r in results[:3]:
        elapsed, missing, message = r.split("|", 2)
        assert float(elapsed) < 3.0
        assert missing == "(3,)"
        assert "rank(s) [3] did not arrive within 1 s" in message
    assert results[3] == "late"


def _dead_rank_barrier() -> str:
    if dist.get_rank() == 2:
        barrier(timeout=30)  # everyone has met once, so peers know each other's pid
        os._exit(1)
    barrier(timeout=30)
    start = time.monotonic()
    try:
        barrier(timeout=60)
    except PeerLostError as exc:
        return f"{time.monotonic() - start:.2f}|{exc}"
    return "no error"


def test_dead_local_rank_is_noticed_long_before_timeout(fresh_job) -> None:
    pool = fresh_job(4)
    results = pool.run(_dead_rank_barrier, timeout=60, expect_deaths=True)
    assert isinstance(results[2], Died)
    for r in (results[0], results[1], results[3]):
        elapsed, message = r.split("|", 1)
        assert float(elapsed) < 5.0, message
        assert "rank(s) [2] exited" in message


def test_layout_usable_without_distributed() -> None:
    assert not dist.is_initialized()
    assert MeshLayout((2, 2)).groups_along(0) == [[0, 2], [1, 3]]
    with pytest.raises(RuntimeError, match="init_process_group"):
        ProcessGroupMesh(2, 2)


def _device_mesh() -> tuple:
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    device_mesh = mesh.to_device_mesh("cpu")
    tp = device_mesh.get_group("tp")
    return (
        device_mesh.mesh.tolist(),
        device_mesh.mesh_dim_names,
        dist.get_process_group_ranks(tp),
        device_mesh.get_coordinate(),
    )


def test_to_device_mesh_keeps_layout_and_names(ranks4: RankPool) -> None:
    results = ranks4.run(_device_mesh)
    for rank, (layout, names, tp_ranks, coordinate) in enumerate(results):
        assert layout == [[0, 1], [2, 3]] and names == ("pp", "tp")
        assert tp_ranks == MeshLayout((2, 2)).group_of(rank, 1)
        assert tuple(coordinate) == MeshLayout((2, 2)).coordinate(rank)


def _stage_manager_pattern() -> dict:
    """ColossalAI's pipeline stage manager: every rank asks for the group of stages [0, 2]."""
    mesh = ProcessGroupMesh(4, backend="gloo")
    rank = dist.get_rank()
    group = mesh.get_group_along_axis(0, [0, 2], group_desc="pp_first_last")
    out: dict = {"member": group is not None, "backend": mesh.backend}
    if group is not None:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out["sum"] = float(t)
        out["ranks"] = dist.get_process_group_ranks(group)
        out["desc"] = getattr(group, "group_desc", "pp_first_last")
    # Creation counts stayed in step: a group along the whole axis still works everywhere.
    whole = mesh.get_group_along_axis(0)
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=whole)
    out["whole"] = float(t)
    out["again"] = mesh.get_group_along_axis(0, [0, 2]) is group  # cached, no new group
    return out


def test_non_members_of_an_indexed_group_get_none_and_stay_in_step(fresh_job) -> None:
    results = fresh_job(4).run(_stage_manager_pattern, timeout=120)
    assert [r["member"] for r in results] == [True, False, True, False]
    assert results[0]["sum"] == results[2]["sum"] == 2.0 and results[0]["ranks"] == [0, 2]
    assert results[0]["desc"] == "pp_first_last"
    assert all(r["whole"] == 4.0 and r["again"] and r["backend"] == "gloo" for r in results)


def _own_config_placement() -> dict:
    from distribute_utils import get_configs_parallel, get_tensors_parallel

    rank = dist.get_rank()
    own = {"w": torch.ones(2), "nested": [torch.zeros(1)], "plain": 1}
    out: dict = {}
    with get_configs_parallel(own, [0, 1, 2, 3]) as got:
        if got:
            out["same_object"] = got[0] is own  # nothing to move: yielded as passed
    with get_tensors_parallel(torch.ones(2, dtype=torch.float64) * rank, [0, 1], device="cpu") as got:
        if got:
            out["devices"] = sorted({str(t.device) for t in got})
    return out


def test_first_ranks_own_values_are_yielded_on_the_target_device(ranks4: RankPool) -> None:
    results = ranks4.run(_own_config_placement)
    assert results[0]["same_object"] is True
    assert results[0]["devices"] == ["cpu"]


@dataclasses.dataclass
class _Linear:
    weight: torch.Tensor
    name: str = "fc"


def _place_own_config_on(device: str) -> dict:
    """Each rank the first rank of its own one-rank gather (disjoint lists under the world): what it yields."""
    from distribute_utils import get_configs_parallel

    keep = {"note": "no tensors", "n": (1, 2)}
    config = {
        "fc": _Linear(torch.ones(2)),
        "list": [torch.zeros(1), 3],
        "pair": (torch.ones(1),),
        "keep": keep,
    }
    with get_configs_parallel(config, [dist.get_rank()], device=device) as got:
        placed = got[0]
        return {
            "same_object": placed is config,
            "caller_untouched": config["fc"].weight.device.type == "cpu",
            "devices": sorted(
                {t.device.type for t in (placed["fc"].weight, placed["list"][0], placed["pair"][0])}
            ),
            "kinds": (type(placed["fc"]) is _Linear, type(placed["pair"]) is tuple, placed["list"][1]),
            "name": placed["fc"].name,
            "keep_shared": placed["keep"] is keep,
        }


def test_placing_the_first_ranks_own_config_copies_only_what_moves(ranks4: RankPool) -> None:
    """The walk behind "every yielded tensor on one device" (``device=``), with the meta device as target."""
    for moved in ranks4.run(_place_own_config_on, "meta"):
        assert not moved["same_object"] and moved["caller_untouched"], "the caller's config is untouched"
        assert moved["devices"] == ["meta"] and moved["kinds"] == (True, True, 3) and moved["name"] == "fc"
        assert moved["keep_shared"], "a subtree without tensors is not copied"
    for kept in ranks4.run(_place_own_config_on, "cpu"):
        assert kept["same_object"], "nothing to move: the same object"
