"""Input layouts (own mesh.json layout, Megatron-LM legacy), renumbering, planning and synthetic models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distribute_utils.consolidate import (
    Concat,
    LayoutError,
    MegatronLegacyLayout,
    OwnLayout,
    RuleTable,
    Same,
    TensorSpec,
    UnsafeCheckpointError,
    open_checkpoint,
    safe_torch_load,
    write_own_layout,
)
from distribute_utils.consolidate.layouts import plan_merge
from distribute_utils.consolidate.megatron import MEGATRON_FILE, write_megatron_legacy
from distribute_utils.consolidate.synthetic import (
    balanced_layers_per_stage,
    gpt_specs,
    make_gpt_state_dict,
    shard_state_dict,
    synthetic_size_for,
)

from harness import temporaries_clean_would_remove

TP, PP, LPS = 2, 2, [3, 1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def model() -> dict[str, torch.Tensor]:
    return make_gpt_state_dict(num_layers=4, hidden=16, ffn_hidden=32, vocab=24, seed=3)


@pytest.fixture(scope="module")
def shards(model: dict[str, torch.Tensor]) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    return shard_state_dict(model, TP, PP, layers_per_stage=LPS)


def _consolidate(layout, rules: RuleTable | None = None) -> dict[str, torch.Tensor]:
    """Single-process reference merge driven by plan_merge."""
    out: dict[str, torch.Tensor] = {}
    loaded = {key: layout.load_shard(*key) for key in layout.shards()}
    for entry in plan_merge(layout, rules or RuleTable.default(gated=False)):
        parts = [loaded[(t, entry.pp_rank)][entry.local_name] for t in range(layout.tp)]
        merged = entry.rule.merge(entry.name, parts, list(range(layout.tp)))
        assert TensorSpec.of(entry.name, merged) == entry.spec
        out[entry.name] = merged
    return out


def _assert_equal_sd(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


# --------------------------------------------------------------------------------------------------------
# Synthetic model and sharding.


def test_synthetic_is_deterministic_and_megatron_named(model: dict[str, torch.Tensor]) -> None:
    again = make_gpt_state_dict(num_layers=4, hidden=16, ffn_hidden=32, vocab=24, seed=3)
    _assert_equal_sd(model, again)
    other = make_gpt_state_dict(num_layers=4, hidden=16, ffn_hidden=32, vocab=24, seed=4)
    assert not torch.equal(model["output_layer.weight"], other["output_layer.weight"])
    assert next(iter(model)) == "embedding.word_embeddings.weight"
    assert model["decoder.layers.2.self_attention.linear_qkv.weight"].shape == (48, 16)
    assert model["decoder.layers.0.mlp.linear_fc2.weight"].shape == (16, 32)
    assert "decoder.layers.3.pre_mlp_layernorm.bias" in model
    assert model["decoder.final_layernorm.weight"].dtype == torch.bfloat16


def test_synthetic_quant_scales() -> None:
    fp8 = make_gpt_state_dict(1, 16, 32, 8, quant_format="fp8")
    assert fp8["decoder.layers.0.mlp.linear_fc1.weight"].dtype == torch.float8_e4m3fn
    assert fp8["decoder.layers.0.mlp.linear_fc1.weight_scale"].shape == ()
    sq = make_gpt_state_dict(1, 16, 32, 8, quant_format="int8_sq")
    assert sq["decoder.layers.0.mlp.linear_fc2.pre_quant_scale"].shape == (32,)
    assert sq["decoder.layers.0.mlp.linear_fc2.weight"].dtype == torch.int8
    awq = make_gpt_state_dict(1, 16, 32, 8, quant_format="int4_awq", awq_group_size=8)
    assert awq["decoder.layers.0.mlp.linear_fc2.weight_scale"].shape == (16, 4)


def test_shard_state_dict_layout(shards: dict[tuple[int, int], dict[str, torch.Tensor]]) -> None:
    assert sorted(shards) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, last = shards[(0, 0)], shards[(0, 1)]
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert {n.split(".")[2] for n in first if n.startswith("decoder.layers.")} == {"0", "1", "2"}
    assert {n.split(".")[2] for n in last if n.startswith("decoder.layers.")} == {"0"}
    assert first["embedding.word_embeddings.weight"].shape == (12, 16)
    assert first["decoder.layers.0.self_attention.linear_proj.weight"].shape == (16, 8)
    assert torch.equal(
        shards[(0, 1)]["decoder.layers.0.input_layernorm.weight"],
        shards[(1, 1)]["decoder.layers.0.input_layernorm.weight"],
    )


def test_shard_state_dict_errors(model: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="summing to 4"):
        shard_state_dict(model, 2, 2, layers_per_stage=[3, 3])
    with pytest.raises(ValueError, match="3 equal parts"):
        shard_state_dict(model, 3, 1)


def test_balanced_layers_and_size_helper() -> None:
    assert balanced_layers_per_stage(5, 2) == [3, 2]
    assert balanced_layers_per_stage(4, 4) == [1, 1, 1, 1]
    dims = synthetic_size_for(2 * 2**30)
    assert abs(dims.nbytes - 2 * 2**30) / 2**31 < 0.1
    assert dims.hidden % 128 == 0 and dims.ffn_hidden == 4 * dims.hidden
    assert dims.nbytes == sum(s.nbytes for s in gpt_specs(**dims.as_kwargs()))  # type: ignore[arg-type]
    small = synthetic_size_for(10**6, multiple=16)
    assert small.hidden >= 16 and 0.3 < small.nbytes / 10**6 < 3


# --------------------------------------------------------------------------------------------------------
# Own layout.


@pytest.mark.parametrize("file_format", ["safetensors", "torch"])
def test_own_layout_round_trip(tmp_path: Path, model, shards, file_format: str) -> None:
    write_own_layout(tmp_path, shards, file_format=file_format, layers_per_stage=LPS)
    desc = json.loads((tmp_path / "mesh.json").read_text())
    assert desc["shape"] == [2, 2] and desc["axis_names"] == ["pp", "tp"] and desc["format_version"] == 1
    layout = open_checkpoint(tmp_path)
    assert isinstance(layout, OwnLayout)
    assert (layout.tp, layout.pp, layout.layers_per_stage) == (2, 2, (3, 1))
    assert layout.file_for(1, 1).name == (
        "rank_00003.safetensors" if file_format == "safetensors" else "rank_00003.pt"
    )
    specs = layout.shard_specs(1, 0)
    assert [s.name for s in specs] == list(shards[(1, 0)])
    assert specs[0] == TensorSpec("embedding.word_embeddings.weight", torch.bfloat16, (12, 16))
    assert (
        layout.global_name("decoder.layers.0.mlp.linear_fc1.weight", 1)
        == "decoder.layers.3.mlp.linear_fc1.weight"
    )
    assert (
        layout.global_name("decoder.layers.2.mlp.linear_fc1.weight", 0)
        == "decoder.layers.2.mlp.linear_fc1.weight"
    )
    assert layout.global_name("output_layer.weight", 1) == "output_layer.weight"
    _assert_equal_sd(_consolidate(layout), model)


def test_own_layout_infers_layers_and_custom_axes(tmp_path: Path, model, shards) -> None:
    write_own_layout(tmp_path, shards, axis_names=("tp", "pp"), files="tp{tp}/pp{pp}-r{rank}.safetensors")
    layout = open_checkpoint(tmp_path)
    assert isinstance(layout, OwnLayout)
    assert layout.layers_per_stage == (3, 1)  # counted from the names
    assert layout.rank_of(1, 0) == 2 and layout.rank_of(0, 1) == 1  # row-major over ["tp", "pp"]
    assert layout.file_for(1, 0) == tmp_path / "tp1" / "pp0-r2.safetensors"
    assert layout.stage_offset(1) == 3
    _assert_equal_sd(_consolidate(layout), model)


def test_own_layout_missing_file(tmp_path: Path, shards) -> None:
    write_own_layout(tmp_path, shards)
    (tmp_path / "rank_00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"rank_00002\.safetensors"):
        open_checkpoint(tmp_path)


def test_own_layout_bad_description(tmp_path: Path, shards) -> None:
    write_own_layout(tmp_path, shards)
    mesh = tmp_path / "mesh.json"
    good = json.loads(mesh.read_text())
    cases = [
        ({"format_version": 2}, "format_version must be 1"),
        ({"axis_names": ["pp", "dp"]}, "axis_names"),
        ({"shape": [2]}, "shape must list"),
        ({"file_format": "gguf"}, "file_format must be one of"),
        ({"files": "rank_{nope}.safetensors"}, "bad files template"),
        ({"files": "same.safetensors"}, "same file name"),
        ({"files": "../x{rank}.safetensors"}, "inside the directory"),
        ({"layers_per_stage": [4]}, "one per stage"),
        ({"extra": 1}, "unknown keys"),
    ]
    for change, message in cases:
        mesh.write_text(json.dumps({**good, **change}))
        with pytest.raises(LayoutError, match=message):
            open_checkpoint(tmp_path)
    mesh.write_text("{not json")
    with pytest.raises(LayoutError, match="not valid JSON"):
        open_checkpoint(tmp_path)


def test_wrong_layers_per_stage_is_caught(tmp_path: Path, shards) -> None:
    write_own_layout(tmp_path, shards, layers_per_stage=[2, 2])
    layout = open_checkpoint(tmp_path)
    with pytest.raises(LayoutError, match=r"layer index 2, but that stage has 2 layers"):
        plan_merge(layout)


def test_plan_merge_checks_tp_consistency(tmp_path: Path, shards) -> None:
    broken = {k: dict(v) for k, v in shards.items()}
    del broken[(1, 1)]["output_layer.weight"]
    write_own_layout(tmp_path, broken)
    with pytest.raises(LayoutError, match=r"stage 1: TP rank 1 .*missing \['output_layer.weight'\]"):
        plan_merge(open_checkpoint(tmp_path))


def test_plan_merge_uses_rules_and_metadata_only(tmp_path: Path, shards) -> None:
    write_own_layout(tmp_path, shards, layers_per_stage=LPS)
    layout = open_checkpoint(tmp_path)
    plan = plan_merge(layout)
    by_name = {e.name: e for e in plan}
    e = by_name["decoder.layers.3.mlp.linear_fc2.weight"]
    assert (e.pp_rank, e.local_name, e.rule, e.spec.shape) == (
        1,
        "decoder.layers.0.mlp.linear_fc2.weight",
        Concat(1),
        (16, 32),
    )
    assert by_name["decoder.final_layernorm.weight"].rule == Same()
    assert plan_merge(layout, RuleTable([("*.linear_proj.weight", "sum")]))  # equal shapes: plannable


def test_plan_merge_names_tensor_and_ranks_on_bad_shapes(tmp_path: Path, shards) -> None:
    broken = {k: dict(v) for k, v in shards.items()}
    broken[(1, 1)]["decoder.final_layernorm.weight"] = torch.zeros(5, dtype=torch.bfloat16)
    write_own_layout(tmp_path, broken)
    with pytest.raises(
        ValueError, match=r"'decoder\.final_layernorm\.weight'.*rank 0: \(16,\), rank 1: \(5,\)"
    ):
        plan_merge(open_checkpoint(tmp_path))


# --------------------------------------------------------------------------------------------------------
# Megatron-LM legacy layout.


def test_megatron_tp_pp_with_iteration(tmp_path: Path, model, shards) -> None:
    write_megatron_legacy(tmp_path, shards, iteration=1200)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1200"
    assert (tmp_path / "iter_0001200" / "mp_rank_01_001" / MEGATRON_FILE).is_file()
    layout = open_checkpoint(tmp_path)
    assert isinstance(layout, MegatronLegacyLayout)
    assert (layout.tp, layout.pp, layout.layers_per_stage) == (2, 2, (3, 1))
    assert layout.file_for(0, 1) == tmp_path / "iter_0001200" / "mp_rank_00_001" / MEGATRON_FILE
    assert [s.name for s in layout.shard_specs(0, 1)] == list(shards[(0, 1)])
    assert (
        layout.global_name("decoder.layers.0.input_layernorm.weight", 1)
        == "decoder.layers.3.input_layernorm.weight"
    )
    _assert_equal_sd(_consolidate(layout), model)
    # The same directory opened at the iteration level, and by explicit iteration.
    assert open_checkpoint(tmp_path / "iter_0001200").tp == 2
    assert open_checkpoint(tmp_path, iteration=1200).pp == 2
    with pytest.raises(FileNotFoundError, match="iter_0000007"):
        open_checkpoint(tmp_path, iteration=7)


def test_megatron_tp_only_nested_legacy_names(tmp_path: Path) -> None:
    sd = {
        "language_model.embedding.word_embeddings.weight": torch.randn(8, 4),
        "language_model.encoder.layers.0.self_attention.query_key_value.weight": torch.randn(12, 4),
        "language_model.encoder.layers.0.self_attention.dense.weight": torch.randn(4, 4),
        "language_model.encoder.layers.0.self_attention.dense.bias": torch.randn(4),
        "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight": torch.randn(16, 4),
        "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight": torch.randn(4, 16),
        "language_model.encoder.final_layernorm.weight": torch.randn(4),
        "language_model.output_layer.weight": torch.randn(8, 4),
    }
    shards = shard_state_dict(sd, 2, 1)
    write_megatron_legacy(tmp_path, shards, nest_depth=2)
    raw = safe_torch_load(tmp_path / "mp_rank_01" / MEGATRON_FILE)
    assert "layers.0.self_attention.dense.weight" in raw["model"]["language_model"]["encoder"]
    layout = open_checkpoint(tmp_path)
    assert (layout.tp, layout.pp, layout.layers_per_stage) == (2, 1, (1,))
    assert layout.file_for(1, 0) == tmp_path / "mp_rank_01" / MEGATRON_FILE
    _assert_equal_sd(_consolidate(layout), sd)


def test_megatron_missing_shard(tmp_path: Path, shards) -> None:
    write_megatron_legacy(tmp_path, shards)
    shutil.rmtree(tmp_path / "mp_rank_01_000")
    with pytest.raises(FileNotFoundError, match=r"mp_rank_01_000/model_optim_rng\.pt"):
        open_checkpoint(tmp_path)
    write_megatron_legacy(tmp_path, shards)
    (tmp_path / "mp_rank_00_001" / MEGATRON_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"mp_rank_00_001/model_optim_rng\.pt"):
        open_checkpoint(tmp_path)


class Opaque:
    """A non-tensor object that weights_only loading must refuse."""


def test_megatron_refuses_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "mp_rank_00" / MEGATRON_FILE
    path.parent.mkdir()
    torch.save({"model": {"w": torch.ones(2)}, "thing": Opaque()}, path)
    with pytest.raises(
        UnsafeCheckpointError, match=r"without running pickled code \(.*Opaque\).*never unpickles"
    ):
        open_checkpoint(tmp_path)


def test_megatron_allows_args_namespace_and_reads_model_chunks(tmp_path: Path) -> None:
    import argparse

    path = tmp_path / "a.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(num_layers=2)}, path)
    assert safe_torch_load(path)["args"].num_layers == 2
    p2 = tmp_path / "mp_rank_00" / MEGATRON_FILE
    p2.parent.mkdir()
    torch.save({"model0": {"w": torch.ones(1)}, "model1": {"w": torch.zeros(1)}}, p2)
    layout = open_checkpoint(tmp_path)
    assert layout.chunks == 2
    assert sorted(layout.load_shard(0, 0)) == ["model0/w", "model1/w"]
    torch.save({"args": 1}, p2)
    with pytest.raises(LayoutError, match=r"has no \['model'\] entry"):
        open_checkpoint(tmp_path).load_shard(0, 0)


def test_unknown_layout_says_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "something.bin").write_bytes(b"x")
    with pytest.raises(
        LayoutError,
        match=r"mesh\.json.*\.metadata.*mp_rank_TT\[_PPP\]\[_EEE\]/model_optim_rng\.pt.*latest_checkpointed_iteration",
    ):
        open_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")


def test_megatron_bad_tracker(tmp_path: Path) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("soon\n")
    with pytest.raises(LayoutError, match="expected an iteration number"):
        open_checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    with pytest.raises(FileNotFoundError, match="iter_0000005"):
        open_checkpoint(tmp_path)


def test_load_shard_is_lazy_for_safetensors(tmp_path: Path, shards) -> None:
    write_own_layout(tmp_path, shards)
    layout = open_checkpoint(tmp_path)
    t = layout.load_shard(0, 0)["embedding.word_embeddings.weight"]
    assert not t.untyped_storage().resizable()  # a view of the mapping, not an owned copy


# --------------------------------------------------------------------------------------------------------
# Megatron args that do not fit the files: refused, never guessed.


def _megatron_files(root: Path, dirs: list[str], **args) -> None:
    import argparse

    for name in dirs:
        path = root / name / MEGATRON_FILE
        path.parent.mkdir(parents=True)
        sd = {
            "decoder.layers.0.mlp.linear_fc2.weight": torch.ones(2, 2),
            "decoder.final_layernorm.weight": torch.ones(2),
        }
        torch.save({"model": sd, "args": argparse.Namespace(**args)}, path)


@pytest.mark.parametrize(
    "dirs, args, message",
    [
        (
            ["mp_rank_00", "mp_rank_01"],
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            r"args say TP 2 x PP 2 x EP 1.*mp_rank_TT_PPP",
        ),
        (
            ["mp_rank_00_000", "mp_rank_01_001"],
            dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
            r"expert_tensor_parallel_size 1 differs.*--ckpt-format torch_dist",
        ),
        (
            ["mp_rank_00", "mp_rank_01"],
            dict(tensor_model_parallel_size=1),
            r"mp_rank_01.*outside the TP 1 x PP 1 grid",
        ),
        (
            ["mp_rank_00"],
            dict(tensor_model_parallel_size=1, num_layers=4),
            r"hold 1 decoder layers.*num_layers=4",
        ),
    ],
)
def test_megatron_args_that_do_not_fit_are_refused(tmp_path: Path, dirs, args, message) -> None:
    _megatron_files(tmp_path, dirs, **args)
    with pytest.raises(LayoutError, match=message):
        open_checkpoint(tmp_path)


def test_write_part_refuses_bytes_outside_the_tensor(tmp_path: Path) -> None:
    from distribute_utils.consolidate import CheckpointFormatError, SafetensorsWriter, TensorSpec

    with SafetensorsWriter(tmp_path, [TensorSpec("w", torch.float32, (2, 2))]) as w:
        with pytest.raises(CheckpointFormatError, match=r"bytes 12\.\.20 lie outside its 16"):
            w.write_part("w", torch.float32, (2, 2), [(12, memoryview(bytes(8)))])
        w.write_part("w", torch.float32, (2, 2), [(8, memoryview(bytes(8)))])
        assert w.missing == ["w"]
        w.write_part("w", torch.float32, (2, 2), [(0, memoryview(bytes(8)))])
        assert w.missing == []


_KILLED_WRITER = """
import sys
from pathlib import Path

import torch

from distribute_utils.consolidate import write_own_layout
from distribute_utils.consolidate.synthetic import make_gpt_state_dict, shard_state_dict

out, ready = Path(sys.argv[1]), Path(sys.argv[2])


class Blocking(torch.Tensor):
    # Pickled by torch.save inside the shard's temporary: says so, then waits for a SIGKILL (stdin
    # stays open and empty).
    def __reduce_ex__(self, protocol):
        ready.write_text("writing")
        sys.stdin.read()
        raise SystemExit("stdin closed before the kill")


sd = make_gpt_state_dict(num_layers=2, hidden=256, ffn_hidden=1024, vocab=4096, seed=1)
shards = shard_state_dict(sd, 1, 2, layers_per_stage=[1, 1])
shards[(0, 1)] = {**shards[(0, 1)], "zz.blocker": torch.zeros(4).as_subclass(Blocking)}
write_own_layout(out, shards, file_format="torch")
"""


def test_clean_removes_the_temporary_of_a_killed_layout_write(tmp_path: Path) -> None:
    """A layout writer killed outright (SIGKILL, mid-``torch.save``) leaves its shard's temporary; it is
    recorded, so ``distribute-utils clean`` lists it (dry run) and removes it. The moment is the writer's
    own signal (a file written from inside the save), not a sleep."""
    out, ready = tmp_path / "ckpt", tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(out), str(ready)],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None:
                pytest.fail(
                    f"the writer ended (exit {proc.returncode}): {proc.stderr.read().decode()[-2000:]}"
                )
            assert time.monotonic() < deadline, "the writer never reached the blocking tensor"
            time.sleep(0.01)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.close()
        proc.stderr.close()
    temps = sorted(out.glob(".*.tmp-*"))
    assert [t.name.split(".tmp-")[0] for t in temps] == [".rank_00001.pt"], sorted(out.iterdir())
    assert not (out / "mesh.json").exists()
    listed = temporaries_clean_would_remove()
    assert str(temps[0]) in listed, (listed, temps)
    done = subprocess.run(
        [sys.executable, "-m", "distribute_utils", "clean"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"removed temporary {temps[0]}" in done.stdout, done.stdout
    assert not list(out.glob(".*.tmp-*")), sorted(out.iterdir())
