"""Distributed TP x PP consolidation (``consolidate_checkpoint``) on 4 real ranks, and in one process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from distribute_utils.consolidate import (
    ConsolidationError,
    ConsolidationReport,
    MergeError,
    RuleTable,
    consolidate_checkpoint,
    load_safetensors,
    plan_checkpoint,
    write_own_layout,
)
from distribute_utils.consolidate.megatron import write_megatron_legacy
from distribute_utils.consolidate.plan import check_space, make_batches
from distribute_utils.consolidate.synthetic import make_gpt_state_dict, shard_state_dict, synthetic_size_for
from distribute_utils.consolidate.tp_pp import peak_rss_bytes

from harness import RankPool

LPS = [3, 1]


# --------------------------------------------------------------------------------------------------------
# Functions run on the ranks (module level: the pool imports them by name).


def _on_rank(inp: str, out: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    return consolidate_checkpoint(inp, out, progress=False, timeout=60, **kwargs).to_dict()


def _error_on_rank(inp: str, out: str, kwargs: dict[str, Any]) -> tuple[str, str, int | None]:
    try:
        consolidate_checkpoint(inp, out, progress=False, timeout=60, **kwargs)
    except ConsolidationError as exc:
        return ("ConsolidationError", str(exc), exc.rank)
    except Exception as exc:
        return (type(exc).__name__, str(exc), None)
    return ("no error", "", None)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _peak_growth_on_rank(inp: str, out: str) -> dict[str, int]:
    """Resets this process's VmHWM to its current RSS, consolidates, returns the peak growth in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS") * 1024
    report = consolidate_checkpoint(inp, out, progress=False, timeout=120)
    return {"growth": peak_rss_bytes() - before, "reported_peak": report.peak_rss_bytes}


# --------------------------------------------------------------------------------------------------------
# Helpers.


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name


def _load_output(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors or torch output directory (sharded or not)."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(out.iterdir()):
        if path.name.endswith(".safetensors"):
            found.update(load_safetensors(path))
        elif path.name.endswith(".bin"):
            found.update(torch.load(path, weights_only=True))
    return found


def _no_leftovers(out: Path) -> None:
    assert not out.exists() or not [p for p in out.iterdir()], list(out.iterdir())


@pytest.fixture(scope="module")
def model() -> dict[str, torch.Tensor]:
    return make_gpt_state_dict(num_layers=4, hidden=64, ffn_hidden=256, vocab=512, seed=7)


@pytest.fixture(scope="module")
def own_st(model: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TP 2 x PP 2, uneven stages [3, 1], safetensors shards."""
    root = tmp_path_factory.mktemp("own_st")
    write_own_layout(root, shard_state_dict(model, 2, 2, layers_per_stage=LPS), layers_per_stage=LPS)
    return root


# --------------------------------------------------------------------------------------------------------
# Bit-exact consolidation.


def test_own_layout_safetensors_tp2_pp2_uneven(
    ranks4: RankPool, model: dict[str, torch.Tensor], own_st: Path, tmp_path: Path, no_shm_leak: None
) -> None:
    out = tmp_path / "out"
    reports = ranks4.run(_on_rank, str(own_st), str(out), {})
    report = ConsolidationReport.from_dict(reports[0])
    _assert_bit_exact(load_safetensors(out / "model.safetensors"), model)
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (report.layout, report.tp, report.pp, report.world_size) == ("own", 2, 2, 4)
    assert report.tensors == len(model)
    assert report.bytes == sum(t.numel() * t.element_size() for t in model.values())
    assert report.transport == "shm" and report.format == "safetensors"
    assert report.files == [str(out / "model.safetensors")]
    assert report.peak_rss_bytes > 0 and report.seconds > 0 and report.mib_per_s > 0
    # every rank returns rank 0's numbers, with its own rank
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert all(r["files"] == report.files and r["bytes"] == report.bytes for r in reports)
    # names come out in plan order: stage 0's layers 0..2, then stage 1's layer renumbered to 3
    names = list(load_safetensors(out / "model.safetensors"))
    assert names.index("decoder.layers.2.mlp.linear_fc2.weight") < names.index(
        "decoder.layers.3.mlp.linear_fc2.weight"
    )


def test_own_layout_torch_inputs_small_batches(
    ranks4: RankPool, model: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    write_own_layout(
        inp, shard_state_dict(model, 2, 2, layers_per_stage=LPS), file_format="torch", layers_per_stage=LPS
    )
    # tiny batches: many rounds, and stage 1 (fewer tensors) sends empty batches at the end
    reports = ranks4.run(_on_rank, str(inp), str(out), {"batch_bytes": 20_000})
    assert reports[0]["rounds"] > 10
    _assert_bit_exact(load_safetensors(out / "model.safetensors"), model)


def test_megatron_legacy_tp2_pp2(ranks4: RankPool, model: dict[str, torch.Tensor], tmp_path: Path) -> None:
    inp, out = tmp_path / "meg", tmp_path / "out"
    write_megatron_legacy(
        inp, shard_state_dict(model, 2, 2, layers_per_stage=LPS), iteration=1200, nest_depth=2
    )
    reports = ranks4.run(_on_rank, str(inp), str(out), {})
    assert reports[0]["layout"] == "megatron_legacy"
    _assert_bit_exact(load_safetensors(out / "model.safetensors"), model)


def test_megatron_legacy_tp_only_on_four_ranks(
    ranks4: RankPool, model: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    inp, out = tmp_path / "meg", tmp_path / "out"
    write_megatron_legacy(inp, shard_state_dict(model, 4, 1))
    assert (inp / "mp_rank_03" / "model_optim_rng.pt").is_file()
    reports = ranks4.run(_on_rank, str(inp), str(out), {})
    assert (reports[0]["tp"], reports[0]["pp"]) == (4, 1)
    _assert_bit_exact(load_safetensors(out / "model.safetensors"), model)


def test_one_process_without_process_group(model: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """No process group (or a world of 1): everything in this process, still streamed."""
    inp, out = tmp_path / "meg", tmp_path / "out"
    write_megatron_legacy(inp, shard_state_dict(model, 2, 1))
    report = consolidate_checkpoint(inp, out, progress=False, batch_bytes=50_000)
    assert (report.world_size, report.transport, report.tp, report.pp) == (1, "none", 2, 1)
    _assert_bit_exact(load_safetensors(out / "model.safetensors"), model)


@pytest.mark.parametrize("quant_format", ["fp8", "int4_awq"])
def test_quantized_rules(ranks4: RankPool, quant_format: str, tmp_path: Path) -> None:
    model = make_gpt_state_dict(num_layers=2, hidden=64, ffn_hidden=128, vocab=256, quant_format=quant_format)
    shards = shard_state_dict(model, 2, 2, quant_format=quant_format)
    if quant_format == "fp8":
        # max-merged scales really differ between TP ranks, and fp8 weights are split
        w = "decoder.layers.0.mlp.linear_fc1.weight_scale"
        assert not torch.equal(shards[(0, 0)][w], shards[(1, 0)][w])
        assert shards[(0, 0)]["decoder.layers.0.mlp.linear_fc1.weight"].dtype == torch.float8_e4m3fn
    else:
        # int4_awq: row-parallel weight scales are concatenated along dim 1
        s = "decoder.layers.0.mlp.linear_fc2.weight_scale"
        assert shards[(0, 0)][s].shape[1] * 2 == model[s].shape[1]
    inp = tmp_path / "in"
    write_own_layout(inp, shards)
    ranks4.run(_on_rank, str(inp), str(tmp_path / "out"), {"quant_format": quant_format})
    _assert_bit_exact(load_safetensors(tmp_path / "out" / "model.safetensors"), model)
    if quant_format == "fp8":
        # without the quantization rules no rule is known for the split scales: every rank fails while
        # planning, naming the tensor and the fix, before anything is written
        results = ranks4.run(_error_on_rank, str(inp), str(tmp_path / "plain"), {})
        assert all(r[0] in ("MergeError", "ConsolidationError") for r in results), results
        message = next(r[1] for r in results if r[0] == "MergeError")
        assert "weight_scale" in message and "no merge rule is known" in message and "--rules" in message
        _no_leftovers(tmp_path / "plain")


def test_rules_file_overrides_defaults(
    ranks4: RankPool, model: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """A rules file is tried first: here the final norm is taken from the first TP rank only."""
    shards = shard_state_dict(model, 2, 2, layers_per_stage=LPS)
    shards[(1, 1)]["decoder.final_layernorm.weight"] = torch.zeros_like(
        shards[(1, 1)]["decoder.final_layernorm.weight"]
    )
    inp = tmp_path / "in"
    write_own_layout(inp, shards, layers_per_stage=LPS)
    rules = tmp_path / "my.rules"
    rules.write_text("decoder.final_layernorm.weight  first  # TP rank 1 has garbage\n")
    ranks4.run(_on_rank, str(inp), str(tmp_path / "out"), {"rules": str(rules)})
    _assert_bit_exact(load_safetensors(tmp_path / "out" / "model.safetensors"), model)


def test_sharded_output_with_index(
    ranks4: RankPool, model: dict[str, torch.Tensor], own_st: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    reports = ranks4.run(_on_rank, str(own_st), str(out), {"max_shard_size": "100KB"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(model) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == reports[0]["bytes"]
    for name in files:
        tensors = load_safetensors(out / name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 100_000
    assert reports[0]["files"][-1].endswith("model.safetensors.index.json")
    _assert_bit_exact(_load_output(out), model)


def test_torch_output_format(
    ranks4: RankPool, model: dict[str, torch.Tensor], own_st: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    reports = ranks4.run(_on_rank, str(own_st), str(out), {"format": "torch", "max_shard_size": "300KB"})
    assert (out / "pytorch_model.bin.index.json").is_file() and reports[0]["format"] == "torch"
    _assert_bit_exact(_load_output(out), model)


def test_batches_cover_every_entry_in_order(own_st: Path) -> None:
    layout, plan = plan_checkpoint(own_st)
    for budget in (1, 10_000, 10**9):
        batches = make_batches(plan, layout.stages, budget)
        flat = [e for stage in batches for batch in stage for e in batch]
        assert flat == plan
        for stage in batches:
            for batch in stage:
                assert batch and (len(batch) == 1 or sum(e.spec.nbytes for e in batch) <= budget)
    assert [len(s) for s in make_batches(plan, layout.stages, 10**9)] == [1, 1]


# --------------------------------------------------------------------------------------------------------
# Failures: every rank raises, the cause is named, nothing is left behind, nobody hangs.


def test_same_mismatch_at_data_time_fails_everywhere(
    ranks4: RankPool, model: dict[str, torch.Tensor], tmp_path: Path, no_shm_leak: None
) -> None:
    shards = shard_state_dict(model, 2, 2, layers_per_stage=LPS)
    norm = "decoder.layers.0.input_layernorm.weight"
    shards[(1, 1)][norm] = shards[(1, 1)][norm] + 1  # same shape: only the bytes differ
    inp, out = tmp_path / "in", tmp_path / "out"
    write_own_layout(inp, shards, layers_per_stage=LPS)
    results = ranks4.run(_error_on_rank, str(inp), str(out), {"batch_bytes": 20_000})
    kinds = [r[0] for r in results]
    # the merge happens on stage 1's first TP rank (global rank 2), which raises the MergeError itself
    assert kinds == ["ConsolidationError", "ConsolidationError", "MergeError", "ConsolidationError"], results
    assert "decoder.layers.3.input_layernorm.weight" in results[2][1]
    assert "rank 3 differs from rank 2" in results[2][1]
    assert all(r[2] == 2 and "(on rank 2)" in r[1] for i, r in enumerate(results) if i != 2)
    _no_leftovers(out)
    # the pool is still healthy
    lenient = RuleTable([("decoder.layers.*.input_layernorm.weight", "first")]).then(RuleTable.default())
    ranks4.run(_on_rank, str(inp), str(tmp_path / "ok"), {"rules": lenient})


def test_shape_mismatch_names_tensor_ranks_and_files(
    ranks4: RankPool, model: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    shards = shard_state_dict(model, 2, 2, layers_per_stage=LPS)
    shards[(1, 1)]["decoder.layers.0.mlp.linear_fc1.weight"] = torch.zeros(128, 65, dtype=torch.bfloat16)
    inp = tmp_path / "in"
    write_own_layout(inp, shards, layers_per_stage=LPS)
    results = ranks4.run(_error_on_rank, str(inp), str(tmp_path / "out"), {})
    kind, message, _ = results[0]
    assert kind == "MergeError"
    assert "tensor 'decoder.layers.3.mlp.linear_fc1.weight'" in message
    assert "rank 0: (128, 64), rank 1: (128, 65)" in message
    assert "TP rank 1 = global rank 3 in" in message and "rank_00003.safetensors" in message
    assert all(r[0] == "ConsolidationError" and r[2] == 0 for r in results[1:])
    _no_leftovers(tmp_path / "out")


def test_missing_shard_and_world_mismatch(
    ranks4: RankPool, model: dict[str, torch.Tensor], own_st: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    write_own_layout(broken, shard_state_dict(model, 2, 2, layers_per_stage=LPS), layers_per_stage=LPS)
    (broken / "rank_00003.safetensors").unlink()
    results = ranks4.run(_error_on_rank, str(broken), str(tmp_path / "out"), {})
    assert results[0][0] == "FileNotFoundError" and "rank_00003.safetensors" in results[0][1]
    tp2 = tmp_path / "tp2"
    write_own_layout(tp2, shard_state_dict(model, 2, 1))
    results = ranks4.run(_error_on_rank, str(tp2), str(tmp_path / "out"), {})
    assert results[0][0] == "ArgumentError" and "needs 2 ranks, but the world has 4" in results[0][1]
    assert results[1][0] == "ConsolidationError"
    _no_leftovers(tmp_path / "out")


def test_space_check_names_the_path(tmp_path: Path) -> None:
    """A filesystem too small is named before any byte moves (a real full disk: tests/test_cli.py)."""
    with pytest.raises(OSError, match="no space left for the consolidated checkpoint") as info:
        check_space(tmp_path / "out", 2**62)
    assert str(tmp_path / "out") in str(info.value)


# --------------------------------------------------------------------------------------------------------
# Memory: rank 0 never holds the model.


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    dims = synthetic_size_for(200 * 2**20, num_layers=8)
    sd = make_gpt_state_dict(**dims.as_kwargs())  # type: ignore[arg-type]
    root = tmp_path_factory.mktemp("big")
    write_own_layout(root, shard_state_dict(sd, 2, 2))
    return root, dims.nbytes


def test_rank0_peak_memory_stays_far_below_model_size(
    ranks4: RankPool, big_model_dir: tuple[Path, int], tmp_path: Path
) -> None:
    inp, nbytes = big_model_dir
    results = ranks4.run(_peak_growth_on_rank, str(inp), str(tmp_path / "out"), timeout=240)
    growth = results[0]["growth"]
    # Rank 0 holds the 16 MiB batches of at most 3 rounds (its own shard is remapped every batch): at worst
    # ~100 MiB, measured ~30 MiB; the model is ~220 MiB, and a naive consolidation holds it twice.
    assert growth < 0.5 * nbytes, (
        f"rank 0 grew by {growth / 2**20:.0f} MiB for a {nbytes / 2**20:.0f} MiB model"
    )
    assert os.path.getsize(tmp_path / "out" / "model.safetensors") > nbytes


def test_plan_errors_outside_a_job(own_st: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plan_checkpoint(tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown output format"):
        consolidate_checkpoint(own_st, tmp_path / "out", format="npz")
    with pytest.raises(ValueError, match="bad size"):
        consolidate_checkpoint(own_st, tmp_path / "out", max_shard_size="12XB")
    with pytest.raises(MergeError):
        # concat along a dim the norms do not have
        plan_checkpoint(own_st, RuleTable([("*layernorm.weight", "concat:1")]))


def _infos_read_in_a_consolidation(inp: str, out: str, tag: str) -> list[int]:
    """On a fresh default group (a new incarnation, nothing read yet), with the watchdog kept from reading
    local peers (its grace longer than the run): one consolidation; the ranks whose infos this rank read."""
    import torch.distributed as dist

    from distribute_utils import liveness, sync

    from harness import remake_group

    remake_group(dist.get_rank(), tag)
    grace, liveness.GRACE_S = liveness.GRACE_S, 1e9
    try:
        consolidate_checkpoint(inp, out, progress=False, timeout=60)
        directory = sync.companion(None).directory
        assert directory is not None
        return sorted(directory.known())
    finally:
        liveness.GRACE_S = grace


def test_only_rank_0_reads_where_every_rank_runs(ranks4: RankPool, own_st: Path, tmp_path: Path) -> None:
    """A consolidation of TP 2 x PP 2 on 4 ranks: rank 0 reads every rank's info (it reports the route),
    every other rank only its gather partners' (its TP group's first rank, or its members): never all-to-all
    (before, every rank read every rank's info to describe the transport)."""
    known = ranks4.run(_infos_read_in_a_consolidation, str(own_st), str(tmp_path / "out"), "infos-read/")
    assert known[0] == [0, 1, 2, 3], known
    assert known[1] == [0, 1] and known[3] == [2, 3], known
    assert 1 not in known[2] and 3 in known[2], known  # (rank 2: its TP member 3, and rank 0 of the stages)
