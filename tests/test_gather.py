"""get_tensors_parallel / get_configs_parallel over shared memory, on 4 real ranks."""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings

import pytest
import torch
import torch.distributed as dist

from distribute_utils import (
    GatherError,
    ProcessGroupMesh,
    gather_configs,
    gather_tensors,
    get_configs_parallel,
    get_tensors_parallel,
    sync,
)

from harness import RankPool

SHM = "/dev/shm"


def _job_pids() -> set[str]:
    """Pids of this job's ranks (collective on the world the first time)."""
    return {str(p.pid) for p in sync.companion(None).peers(30)}


def _ours(pids: set[str]) -> set[str]:
    """Segments made by this job's ranks (names end in the owner's pid; others may run jobs too)."""
    return {n for n in os.listdir(SHM) if n.startswith("du_") and n.rsplit("_", 1)[-1] in pids}


def _all_dtypes() -> list[torch.dtype]:
    """Every dtype torch can make a plain CPU tensor of (quantized dtypes need their scales)."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(torch):
            dtype = getattr(torch, name)
            if isinstance(dtype, torch.dtype) and dtype not in found:
                try:
                    if torch.empty(2, dtype=dtype).is_quantized:
                        continue
                except Exception:
                    continue
                found.append(dtype)
    return found


def _sample(rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic bytes of ``dtype`` and ``shape`` for ``rank`` (any dtype, NaNs included)."""
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(1000 * rank + n)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def _every_dtype_and_shape() -> list[str]:
    rank = dist.get_rank()
    problems = []
    shapes = [(3, 5), (), (0,), (2, 0, 3), (7,), (4, 3, 2)]
    for i, dtype in enumerate(_all_dtypes()):
        shape = shapes[(i + rank) % len(shapes)]
        mine = _sample(rank, dtype, shape)
        with get_tensors_parallel(mine, [0, 1, 2, 3], timeout=30) as got:
            if rank == 0:
                for r, t in enumerate(got):
                    want = _sample(r, dtype, shapes[(i + r) % len(shapes)])
                    if not _same_bits(t, want):
                        problems.append(f"{dtype} from rank {r}: {t.dtype} {tuple(t.shape)}")
            elif got != []:
                problems.append(f"rank {rank} got {got}")
    return problems


def test_every_dtype_and_shape_bit_exact(ranks4: RankPool, no_shm_leak: None) -> None:
    assert ranks4.run(_every_dtype_and_shape, timeout=120) == [[], [], [], []]


def _views_and_mixed_dtypes() -> list[str]:
    rank = dist.get_rank()
    base = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64) * (rank + 1)
    views = {
        "transpose": base[:8, :16].t(),
        "step": base[::512, ::7],
        "row": base[100],
        "expanded": torch.tensor([1.5, 2.5]).expand(3, 2),
        "bf16": base[:2, :3].to(torch.bfloat16).t(),
    }
    problems = []
    for name, view in views.items():
        with get_tensors_parallel(view, [0, 1, 2, 3], timeout=30) as got:
            if rank == 0:
                for r, t in enumerate(got[1:], start=1):
                    other = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64) * (r + 1)
                    expect = {
                        "transpose": other[:8, :16].t(),
                        "step": other[::512, ::7],
                        "row": other[100],
                        "expanded": torch.tensor([1.5, 2.5]).expand(3, 2),
                        "bf16": other[:2, :3].to(torch.bfloat16).t(),
                    }[name]
                    if not _same_bits(t, expect):
                        problems.append(f"{name} from {r}")
                    # Only the view's elements travel: the received tensor is not a whole base.
                    if t.untyped_storage().nbytes() > 64 * 1024:
                        problems.append(f"{name} from {r}: storage of {t.untyped_storage().nbytes()} bytes")
    return problems


def test_views_carry_only_their_elements(ranks4: RankPool, no_shm_leak: None) -> None:
    assert ranks4.run(_views_and_mixed_dtypes) == [[], [], [], []]


@dataclasses.dataclass
class LayerConfig:
    name: str
    weight: torch.Tensor
    scales: dict[str, torch.Tensor]
    bias: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Quant:
    algo: str
    bits: int


def _config_for(rank: int) -> object:
    if rank == 2:
        return None
    return {
        "layer": LayerConfig(f"l{rank}", torch.full((2, 2), float(rank)), {"w": torch.tensor(rank * 0.5)}),
        "quant": Quant("awq", 4),
        "ids": (rank, 2**70, -(2**65)),
        "nested": [[1, (2, 3)], {"k": b"\x00\xff"}],
        7: "int key",
        "f": float("-inf"),
        "flag": rank % 2 == 0,
    }


def _configs_round_trip() -> list[str]:
    rank = dist.get_rank()
    with get_configs_parallel(_config_for(rank), [0, 1, 2, 3], timeout=30) as got:
        if rank != 0:
            return ["nonempty"] if got else []
        problems = []
        if got[2] is not None:
            problems.append("None config lost its position")
        for r in (0, 1, 3):
            want, have = _config_for(r), got[r]
            if list(have) != list(want):
                problems.append(f"key order from {r}: {list(have)}")
            layer = have["layer"]
            if type(layer) is not LayerConfig or type(have["quant"]) is not Quant:
                problems.append(f"dataclass types from {r}: {type(layer)}")
            if not torch.equal(layer.weight, want["layer"].weight) or layer.bias is not None:
                problems.append(f"tensor in dataclass from {r}")
            if not torch.equal(layer.scales["w"], want["layer"].scales["w"]):
                problems.append(f"0-d tensor from {r}")
            for key in ("ids", "nested", 7, "f", "flag", "quant"):
                if have[key] != want[key] or type(have[key]) is not type(want[key]):
                    problems.append(f"{key!r} from {r}: {have[key]!r}")
            if type(have["nested"][0][1]) is not tuple:
                problems.append("tuple inside list became a list")
        return problems


def test_configs_round_trip_exactly_and_keep_none_positions(ranks4: RankPool, no_shm_leak: None) -> None:
    assert ranks4.run(_configs_round_trip) == [[], [], [], []]


def _unsupported_value_before_any_write() -> str:
    rank = dist.get_rank()
    pids = _job_pids()
    config = {"layers": [{"act_fn": "gelu"}] * 4}
    if rank == 2:
        config = {"layers": [{"act_fn": "gelu"}, {}, {}, {"act_fn": lambda x: x}]}
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:  # records any segment appearing while the call runs
        while not stop.is_set():
            seen.update(_ours(pids))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with get_configs_parallel(config, [0, 1, 2, 3], timeout=30):
            pass
    except TypeError as exc:
        return f"{exc}|{sorted(seen)}"
    finally:
        stop.set()
        watcher.join()
    return "no error"


def test_unsupported_value_named_by_path_on_every_rank_before_writes(ranks4: RankPool) -> None:
    results = ranks4.run(_unsupported_value_before_any_write)
    for rank, result in enumerate(results):
        message, seen = result.split("|")
        assert "config['layers'][3]['act_fn']" in message or "config.layers[3].act_fn" in message, message
        assert seen == "[]", f"rank {rank} saw segments {seen}"
        if rank != 2:
            assert "rank 2" in message


def _bad_ranks(case: str) -> str:
    rank = dist.get_rank()
    ranks = {
        "duplicate": [0, 1, 1, 3],
        "outside": [0, 1, 9],
        "empty": [],
        "differ": [0, 1, 2, 3] if rank != 1 else [0, 2, 1, 3],
        "not int": [0, "1"],
    }[case]
    try:
        with get_tensors_parallel(torch.ones(2), ranks, timeout=30):
            pass
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("duplicate", "more than once"),
        ("outside", "outside the world (valid: 0..3)"),
        ("empty", "ranks is empty"),
        ("differ", "ranks disagree on a gather"),
        ("not int", "must be ints"),
    ],
)
def test_bad_ranks_raise_value_error_on_every_rank(ranks4: RankPool, case: str, expected: str) -> None:
    for message in ranks4.run(_bad_ranks, case):
        assert expected in message, message


def _overlapping_lists() -> list[str]:
    """Ranks 0 and 1 pass [0, 1, 2], ranks 2 and 3 pass [2, 3] (they share rank 2): then a gather of
    all four. What each rank's two calls raised ('ok': nothing)."""
    rank = dist.get_rank()
    said = []
    for ranks in ([0, 1, 2] if rank < 2 else [2, 3], [0, 1, 2, 3]):
        try:
            with get_tensors_parallel(torch.ones(2), ranks, timeout=60):
                pass
            said.append("ok")
        except ValueError as exc:
            said.append(str(exc))
        dist.barrier()
    return said


def test_overlapping_lists_are_named_on_every_rank(ranks4: RankPool) -> None:
    """Ranks 2 and 3 complete their own gather; rank 0, which waits for rank 2, asks it what it does:
    rank 2 warns at once and its next gather fails naming the disagreement, and so does rank 3's (before,
    ranks 2 and 3 went on without a word, and rank 0 said only that rank 2 exited if it did)."""
    said = ranks4.run(_overlapping_lists)
    for rank in (0, 1):
        assert "ranks disagree on a gather: rank 0 passed ranks=[0, 1, 2]" in said[rank][0], said[rank]
        assert "passed ranks=[2, 3]" in said[rank][0], said[rank]
    for rank in (2, 3):
        assert said[rank][0] == "ok", said[rank]
        assert "which names rank 2, but rank 2 passed ranks=[2, 3] in the same call" in said[rank][1], said[
            rank
        ]


def _unknown_transport() -> str:
    try:
        with get_tensors_parallel(torch.ones(1), [0, 1], transport="carrier-pigeon"):
            pass
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_unknown_transport(ranks4: RankPool) -> None:
    for message in ranks4.run(_unknown_transport):
        assert (
            "unknown transport 'carrier-pigeon'; valid: ['auto', 'shm', 'workspace', 'collective']" in message
        )


def _kept_after_block_and_body_errors() -> dict:
    rank = dist.get_rank()
    pids = _job_pids()
    out: dict = {}
    kept: list[torch.Tensor] = []
    with get_tensors_parallel(
        torch.full((1000,), float(rank)), [0, 1, 2, 3], transport="shm", timeout=30
    ) as got:
        kept = list(got)
    out["left_after_ok"] = sorted(_ours(pids))
    if rank == 0:
        out["kept"] = [float(t.sum()) for t in kept]
        kept[1].add_(1)  # the caller may write into what it keeps
        out["written"] = float(kept[1][0])
    try:
        with get_tensors_parallel(torch.ones(4096), [0, 1, 2, 3], timeout=30):
            raise KeyError("body failed")
    except KeyError:
        out["body_error"] = True
    dist.barrier()
    out["left_after_error"] = sorted(_ours(pids))
    return out


def test_kept_tensors_stay_valid_and_nothing_left_in_shm(ranks4: RankPool, no_shm_leak: None) -> None:
    results = ranks4.run(_kept_after_block_and_body_errors)
    assert results[0]["kept"] == [0.0, 1000.0, 2000.0, 3000.0]
    assert results[0]["written"] == 2.0
    for r in results:
        assert r["left_after_ok"] == [] and r["left_after_error"] == [] and r["body_error"]


def _subsets_and_single() -> list:
    rank = dist.get_rank()
    out = []
    with get_tensors_parallel(torch.tensor([rank]), [3], timeout=30) as got:
        out.append([int(t) for t in got])
    with get_tensors_parallel(torch.tensor([rank]), [2, 0], timeout=30) as got:
        out.append([int(t) for t in got])
    group = dist.new_group([1, 2, 3])
    if rank != 0:
        with get_configs_parallel({"r": rank}, [3, 1], group, timeout=30) as got:
            out.append(got)
    return out


def test_single_rank_subsets_and_non_participants(ranks4: RankPool) -> None:
    results = ranks4.run(_subsets_and_single)
    assert [r[0] for r in results] == [[], [], [], [3]]
    assert [r[1] for r in results] == [[], [], [2, 0], []]
    assert [r[2:] for r in results] == [[], [[]], [[]], [[{"r": 3}, {"r": 1}]]]


def _mesh_aware() -> list:
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    rank = dist.get_rank()
    out = []
    with gather_tensors(torch.tensor([rank * 10]), mesh, "tp", timeout=30) as got:
        out.append([int(t) for t in got])
    with gather_configs({"stage": mesh.coordinate("pp")}, mesh, "pp", timeout=30) as got:
        out.append(got)
    return out


def test_mesh_aware_gathers_go_to_first_rank_of_each_group(ranks4: RankPool) -> None:
    results = ranks4.run(_mesh_aware)
    assert [r[0] for r in results] == [[0, 10], [], [20, 30], []]
    assert [r[1] for r in results] == [[{"stage": 0}, {"stage": 1}], [{"stage": 0}, {"stage": 1}], [], []]


def _device_argument() -> list:
    rank = dist.get_rank()
    with get_tensors_parallel(torch.ones(2) * rank, [0, 1], timeout=30, device="cpu") as got:
        return [str(t.device) for t in got]


def test_device_argument_places_results(ranks4: RankPool) -> None:
    assert ranks4.run(_device_argument)[0] == ["cpu", "cpu"]


def _reader_failure_reaches_senders() -> str:
    # A sender whose config type the reader cannot rebuild: the dataclass lives in a module
    # that only the sender has imported, so the first rank fails and every sender hears of it.
    rank = dist.get_rank()
    if rank == 1:
        import types

        mod = types.ModuleType("only_on_rank_one")
        import sys

        sys.modules["only_on_rank_one"] = mod

        @dataclasses.dataclass
        class Hidden:
            x: int

        Hidden.__module__ = "only_on_rank_one"
        Hidden.__qualname__ = "Hidden"
        mod.Hidden = Hidden
        config: object = Hidden(1)
    else:
        config = {"x": rank}
    try:
        with get_configs_parallel(config, [0, 1, 2, 3], timeout=30):
            pass
    except (GatherError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_reader_failure_is_reported_to_every_rank(ranks4: RankPool, no_shm_leak: None) -> None:
    results = ranks4.run(_reader_failure_reaches_senders)
    assert "only_on_rank_one" in results[0] and "rank 1" in results[0]
    for r in results[1:]:  # (the first rank's own error type: one except serves every rank)
        assert r.startswith("PayloadError: the first rank (0) failed: ") and "only_on_rank_one" in r


def _concurrent_job(tag: int) -> list[str]:
    rank = dist.get_rank()
    problems = []
    for i in range(40):
        t = torch.full((1024 + i,), float(tag * 1000 + rank * 100 + i))
        with get_tensors_parallel(t, [0, 1], timeout=60) as got:
            if rank == 0:
                for r, g in enumerate(got):
                    if g.shape != (1024 + i,) or not torch.all(g == tag * 1000 + r * 100 + i):
                        problems.append(f"job {tag} round {i} rank {r}")
    return problems


def test_two_jobs_on_one_host_do_not_interfere(pools, no_shm_leak: None) -> None:
    a, b = RankPool(2), RankPool(2)
    pools.pids.update(a.pids + b.pids)
    results: dict[int, list] = {}
    try:
        threads = [
            threading.Thread(
                target=lambda p=p, t=t: results.__setitem__(t, p.run(_concurrent_job, t, timeout=120))
            )
            for p, t in ((a, 1), (b, 2))
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        a.close()
        b.close()
    assert results == {1: [[], []], 2: [[], []]}


def _collective_transport() -> list[str]:
    rank = dist.get_rank()
    problems = []
    shapes = [(3, 5), (), (0,), (1000,)]
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]):
        mine = _sample(rank, dtype, shapes[(i + rank) % 4])
        config = {"t": mine, "view": torch.arange(64.0).reshape(8, 8)[::2, 1::3], "r": rank, "none": None}
        with get_configs_parallel(config, [3, 0, 1, 2], transport="collective", timeout=30) as got:
            if rank == 3:
                for r, c in zip([3, 0, 1, 2], got):
                    if not _same_bits(c["t"], _sample(r, dtype, shapes[(i + r) % 4])) or c["r"] != r:
                        problems.append(f"{dtype} from {r}")
                    if not torch.equal(c["view"], torch.arange(64.0).reshape(8, 8)[::2, 1::3]):
                        problems.append(f"view from {r}")
    return problems


def test_collective_transport_carries_ragged_payloads_exactly(ranks4: RankPool, no_shm_leak: None) -> None:
    assert ranks4.run(_collective_transport) == [[], [], [], []]


def _workspace_without_path() -> str:
    try:
        with get_tensors_parallel(torch.ones(2), [0, 1, 2, 3], transport="workspace", timeout=30):
            pass
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_workspace_transport_without_path_is_refused_everywhere(ranks4: RankPool) -> None:
    for message in ranks4.run(_workspace_without_path):
        assert "transport='workspace' needs a workspace_path" in message


def _mesh_collective() -> list:
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    rank = dist.get_rank()
    out = []
    for _ in range(2):  # the second round reuses the cached gloo group of the axis
        with gather_tensors(
            torch.tensor([rank, rank]), mesh, "pp", transport="collective", timeout=30
        ) as got:
            out.append([t.tolist() for t in got])
    return out


def test_mesh_gather_over_the_collective_transport(ranks4: RankPool) -> None:
    results = ranks4.run(_mesh_collective)
    assert results[0] == [[[0, 0], [2, 2]]] * 2 and results[1] == [[[1, 1], [3, 3]]] * 2
    assert results[2] == [[], []] and results[3] == [[], []]


def _cuda_tensors(device: str | None) -> list:
    rank = dist.get_rank()
    local = torch.device("cuda", rank % torch.cuda.device_count())
    mine = torch.arange(1000, device=local, dtype=torch.bfloat16)[::3] * (rank + 1)  # (not contiguous)
    with get_tensors_parallel(mine, [0, 1, 2, 3], timeout=60, device=device) as got:
        return [(str(t.device.type), t.cpu().tolist()) for t in got]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
@pytest.mark.parametrize("device", [None, "cuda"])
def test_cuda_tensors_travel_through_host_shared_memory(ranks4: RankPool, device: str | None) -> None:
    results = ranks4.run(_cuda_tensors, device)
    expected = [(torch.arange(1000, dtype=torch.bfloat16)[::3] * (r + 1)).tolist() for r in range(4)]
    assert [values for _, values in results[0]] == expected
    devices = {kind for kind, _ in results[0]}  # the first rank's own tensor too
    assert devices == ({"cpu"} if device is None else {"cuda"})


def test_without_distributed_every_entry_says_what_to_call() -> None:
    """No default process group: a gather or a barrier raises at once, naming what to call (the
    group is looked up before anything else, so that is where the message comes from)."""
    assert not dist.is_initialized()
    says = r"call torch.distributed.init_process_group\(\)"
    with pytest.raises(RuntimeError, match=says), get_tensors_parallel(torch.ones(1), [0]):
        pass
    with pytest.raises(RuntimeError, match=says), get_configs_parallel({"a": 1}, [0]):
        pass
    with pytest.raises(RuntimeError, match=says):
        sync.barrier()
