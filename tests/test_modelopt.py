"""ModelOpt's own export code, with its helpers and then with ours, compared bit for bit.

``modelopt.torch.export.postprocess.postprocess_model_config`` is the archetypal caller of
``get_tensors_parallel`` / ``get_configs_parallel``. Each rank builds its shard of a small
llama-style model with ModelOpt's own config dataclasses (bfloat16, with and without FP8
scales), runs ModelOpt's postprocessing once with ModelOpt's helpers and once with
:mod:`distribute_utils.modelopt` patched into ``modelopt.torch.export.postprocess``, and the
two results must agree in every field and every tensor byte. A reference computed without any
gather checks that the merge did something.

Fresh ranks per world size: ModelOpt's TP merge makes a torch group on the TP ranks only,
which torch allows only while the ranks' group histories agree.

The gpu-marked tests run the same exports with every shard's tensors on its rank's GPU (gloo ranks
sharing the GPUs there are): ModelOpt's export math then runs on the devices its helpers put each
layer on, so ours must put them on the same devices for the bytes to agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import load_script

HIDDEN, FFN, VOCAB, LAYERS = 64, 128, 96, 2


def _bench() -> Any:
    """The model builder and the patched export, shared with scripts/bench_modelopt_export.py."""
    return load_script("bench_modelopt_export")


def _tensor(shape: tuple[int, ...], *seed: int) -> torch.Tensor:
    return _bench().tensor(shape, *seed)


def _export(
    tp: int, pp: int, quant: str, helpers: str, workspace: str | None, gpu: bool = False
) -> dict[str, Any]:
    bench = _bench()
    model = bench.shard(tp, pp, quant, HIDDEN, FFN, VOCAB, LAYERS)
    if gpu:  # each rank's shard on its GPU (rank r on cuda:r, or all on cuda:0 where there is one)
        model = bench.moved(model, bench.rank_device("cuda"))
    configs = bench.export(model, pp, helpers, workspace)
    dist.barrier()
    return bench.flatten(configs)


def _run_both(tp: int, pp: int, quant: str, workspace: str | None, gpu: bool = False) -> dict[str, Any]:
    theirs = _export(tp, pp, quant, "modelopt", workspace, gpu)
    ours = _export(tp, pp, quant, "ours", workspace, gpu)
    differing = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    return {"rank": dist.get_rank(), "keys": len(ours), "differing": differing[:10], "flat": ours}


def _reference_q(tp: int, pp: int, layer: int) -> torch.Tensor:
    """Layer ``layer``'s merged q weight, computed without any gather."""
    stage, i = divmod(layer, LAYERS)
    return torch.cat([_tensor((HIDDEN // tp, HIDDEN), stage * LAYERS + i, t, 0) for t in range(tp)])


def _check(
    results: list[dict[str, Any]],
    tp: int,
    pp: int,
    resmoothed: bool = False,
    devices: list[str] | None = None,
) -> None:
    """Ours equal ModelOpt's everywhere (bytes, dtypes, shapes and devices); merged q weights equal a
    gather-free reference (INT4 AWQ re-smooths merged weights, so there only shapes are checked
    against it). ``devices``: each layer's expected device (default: all on the CPU)."""
    for r in results:
        assert r["differing"] == [], (
            f"rank {r['rank']}: ModelOpt's helpers and ours differ at {r['differing']}"
        )
    merged = results[0]["flat"]
    assert merged[":len"] == 1 and all(r["flat"] == {":len": 0} for r in results[1:])
    assert merged["[0].layers:len"] == LAYERS * pp
    for layer in range(LAYERS * pp):
        dtype, shape, device, data = merged[f"[0].layers[{layer}].attention.qkv.q.weight"]
        expected = _reference_q(tp, pp, layer)
        want = "cpu" if devices is None else devices[layer]
        assert (dtype, shape, device) == ("torch.bfloat16", (HIDDEN, HIDDEN), want), f"layer {layer}"
        if not resmoothed:
            assert data == expected.reshape(-1).view(torch.uint8).numpy().tobytes(), f"layer {layer}"
    assert merged["[0].lm_head.weight"][1] == (VOCAB, HIDDEN)


@pytest.mark.parametrize(
    "quant",
    [
        pytest.param("bf16", marks=pytest.mark.slow),
        "fp8",
        pytest.param("int4_awq", marks=pytest.mark.slow),  # (fp8 in the default suite)
        pytest.param("int8_sq", marks=pytest.mark.slow),
        pytest.param("nvfp4", marks=pytest.mark.slow),
    ],
)
def test_modelopt_tp2_pp2_export_is_identical_with_our_helpers(fresh_job: Any, quant: str) -> None:
    results = fresh_job(4).run(_run_both, 2, 2, quant, None, timeout=180)
    _check(results, tp=2, pp=2, resmoothed=quant == "int4_awq")


def test_modelopt_tp2_and_pp2_exports_and_workspace_are_identical_with_our_helpers(
    fresh_job: Any, tmp_path: Any
) -> None:
    pool = fresh_job(2)
    _check(pool.run(_run_both, 2, 1, "fp8", None, timeout=180), tp=2, pp=1)
    _check(pool.run(_run_both, 1, 2, "bf16", None, timeout=180), tp=1, pp=2)
    # ModelOpt's NFS path: the pipeline merge through a shared directory. ModelOpt creates it on
    # rank 0 only while the others write into it at once (its documented race): make it first.
    (tmp_path / "ws").mkdir()
    _check(pool.run(_run_both, 1, 2, "bf16", str(tmp_path / "ws"), timeout=180), tp=1, pp=2)


def _none_configs() -> dict[str, Any]:
    from distribute_utils import get_configs_parallel
    from distribute_utils import modelopt as compat

    rank = dist.get_rank()
    config = None if rank in (1, 3) else {"rank": rank, "w": torch.full((2,), float(rank))}
    out: dict[str, Any] = {}
    with compat.get_configs_parallel(config, [0, 1, 2, 3], None) as got:
        out["compat"] = [None if c is None else c["rank"] for c in got]
    with get_configs_parallel(config, [0, 1, 2, 3]) as got:
        out["ours"] = [None if c is None else c["rank"] for c in got]
    with compat.get_configs_parallel(
        config, [3, 0, 1, 2], None
    ) as got:  # ModelOpt keeps the first's own None
        out["first_none"] = [None if c is None else c["rank"] for c in got]
    return out


def test_compat_drops_other_ranks_none_configs_as_modelopt_does(ranks4: Any) -> None:
    results = ranks4.run(_none_configs)
    assert results[0]["compat"] == [0, 2], "ModelOpt's callers read configs[-1] as the last rank that had one"
    assert results[0]["ours"] == [0, None, 2, None], "our own function keeps every position"
    assert results[3]["first_none"] == [None, 0, 2]
    assert results[1]["compat"] == results[1]["ours"] == []


# --------------------------------------------------------------------------- on a GPU

# (tp, pp) of the training job, exported to TP1 x PP1: tensor-parallel, pipeline-parallel and both.
GPU_SHAPES = [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]


def _gpu_layer_devices(tp: int, pp: int, theirs: list[dict[str, Any]]) -> list[str]:
    """Where ModelOpt's own export leaves each merged layer's q weight (what ours must match)."""
    return [theirs[0]["flat"][f"[0].layers[{n}].attention.qkv.q.weight"][2] for n in range(LAYERS * pp)]


def _run_cases(cases: list[tuple[int, int, str]], gpu: bool) -> list[dict[str, Any]]:
    return [_run_both(tp, pp, quant, None, gpu) for tp, pp, quant in cases]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
@pytest.mark.parametrize("world", [2, 4])
def test_modelopt_gpu_exports_are_identical_with_our_helpers(fresh_job: Any, world: int) -> None:
    """ModelOpt's export of CUDA shards, every TP, PP and TP x PP shape of ``world`` ranks (FP8 for
    each; BF16, INT4 AWQ, INT8 SQ and NVFP4 too for TP2 x PP2), bit for bit and device for device with ModelOpt's
    own helpers. A pipeline merge receives other stages' layers: they must come back on their
    senders' GPUs (ModelOpt's ``torch.load``), where its FP8 export then quantizes them."""
    pytest.importorskip("modelopt.torch.export")
    cases = [(tp, pp, "fp8") for tp, pp in GPU_SHAPES if tp * pp == world]
    if world == 4:
        cases += [(2, 2, quant) for quant in ("bf16", "int4_awq", "int8_sq", "nvfp4")]
    per_case = list(zip(*fresh_job(world).run(_run_cases, cases, True, timeout=300)))
    count = torch.cuda.device_count()
    for (tp, pp, quant), results in zip(cases, per_case):
        devices = _gpu_layer_devices(tp, pp, list(results))
        if tp == 1:  # no TP merge: stage s's layers stay on (or come back to) rank s's GPU
            assert devices == [f"cuda:{(n // LAYERS) % count}" for n in range(LAYERS * pp)], (tp, pp, quant)
        _check(list(results), tp=tp, pp=pp, resmoothed=quant == "int4_awq", devices=devices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_modelopt_gpu_pipeline_export_through_a_workspace_is_identical(fresh_job: Any, tmp_path: Any) -> None:
    """ModelOpt's NFS path loads received layers with ``map_location="cpu"``: ours must too."""
    pytest.importorskip("modelopt.torch.export")
    (tmp_path / "ws").mkdir()
    results = fresh_job(2).run(_run_both, 1, 2, "fp8", str(tmp_path / "ws"), True, timeout=300)
    devices = _gpu_layer_devices(1, 2, results)
    assert devices[:LAYERS] == ["cuda:0"] * LAYERS and devices[LAYERS:] == ["cpu"] * LAYERS
    _check(results, tp=1, pp=2, devices=devices)
