"""Merge rules, rule tables, rules files, Megatron defaults and ModelOpt quantized rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distribute_utils.consolidate import (
    Concat,
    First,
    Max,
    MergeError,
    RuleSyntaxError,
    RuleTable,
    Same,
    ScalarMax,
    Sum,
    TensorSpec,
    Unknown,
    parse_rule,
)
from distribute_utils.consolidate.layouts import global_layer_name
from distribute_utils.consolidate.rules import quantized_rule
from distribute_utils.consolidate.synthetic import make_gpt_state_dict, shard_state_dict
from distribute_utils.errors import DistributeError


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# --------------------------------------------------------------------------------------------------------
# Rules.


def test_concat_dims() -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 12.0).reshape(2, 3)
    assert torch.equal(Concat(0).merge("w", [a, b]), torch.cat([a, b], 0))
    assert torch.equal(Concat(1).merge("w", [a, b]), torch.cat([a, b], 1))
    assert torch.equal(Concat(-1).merge("w", [a, b]), torch.cat([a, b], 1))
    assert Concat(0).merged_shape("w", [(2, 3), (4, 3)]) == (6, 3)
    assert Concat(-1).merged_shape("w", [(2, 3), (2, 5)]) == (2, 8)


def test_concat_other_dims_must_agree_names_tensor_and_ranks() -> None:
    with pytest.raises(MergeError, match=r"'x\.weight'.*rank 4: \(2, 3\), rank 5: \(2, 4\)"):
        Concat(0).merged_shape("x.weight", [(2, 3), (2, 4)], ranks=[4, 5])
    with pytest.raises(MergeError, match="shard 1"):
        Concat(0).merge("x.weight", [torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(MergeError, match="different numbers of dims"):
        Concat(0).merged_shape("x", [(2, 3), (2,)])


def test_concat_scalar_and_bad_dim() -> None:
    with pytest.raises(MergeError, match=r"'s'.*0-d \(scalar\)"):
        Concat(0).merge("s", [torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(MergeError, match="only 1 dims"):
        Concat(1).merged_shape("v", [(3,), (3,)])


def test_dtype_mismatch_is_an_error_for_every_rule() -> None:
    for rule in (Concat(0), Max(), Sum(), Same(), First()):
        with pytest.raises(
            MergeError, match=r"'t'.*dtypes differ.*rank 0: torch.float32, rank 1: torch.bfloat16"
        ):
            rule.merge("t", [torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], ranks=[0, 1])


def test_max_sum_elementwise_and_shape_checks() -> None:
    a, b = torch.tensor([1.0, 5.0, -2.0]), torch.tensor([3.0, 4.0, -1.0])
    assert torch.equal(Max().merge("s", [a, b]), torch.tensor([3.0, 5.0, -1.0]))
    assert torch.equal(Sum().merge("s", [a, b]), a + b)
    assert torch.equal(Max().merge("s", [torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor(2.0))
    for rule in (Max(), Sum(), Same()):
        with pytest.raises(MergeError, match=r"'s'.*equal shapes.*rank 2: \(3,\), rank 3: \(4,\)"):
            rule.merged_shape("s", [(3,), (4,)], ranks=[2, 3])


def test_max_and_sum_on_float8_are_exact() -> None:
    a = torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e4m3fn)
    b = torch.tensor([0.5, 4.0, 0.25]).to(torch.float8_e4m3fn)
    assert Max().merge("s", [a, b]).float().tolist() == [1.0, 4.0, 0.5]
    assert Sum().merge("s", [a, torch.zeros_like(a)]).float().tolist() == [1.0, 2.0, 0.5]


def test_same_is_bitwise_and_names_differing_ranks() -> None:
    a = torch.tensor([1.0, float("nan")])
    assert Same().merge("n", [a, a.clone()]) is a  # NaN == NaN bit for bit
    with pytest.raises(MergeError, match=r"'n'.*but ranks 9 and 11 differ from rank 8;"):
        Same().merge("n", [a, a + 1, a.clone(), a - 1], ranks=[8, 9, 10, 11])
    with pytest.raises(MergeError, match=r"but shard 1 differs from shard 0;"):
        Same().merge("z", [torch.tensor([0.0]), torch.tensor([-0.0])])
    f8 = torch.ones(3).to(torch.float8_e4m3fn)
    assert Same().merge("f8", [f8, f8.clone()]) is f8


def test_first_keeps_first_and_ignores_shapes() -> None:
    a = torch.ones(2)
    assert First().merge("f", [a, torch.zeros(5)]) is a
    assert First().merged_shape("f", [(2,), (5,)]) == (2,)


def test_no_shards_and_rank_count_mismatch() -> None:
    with pytest.raises(MergeError, match="no shards"):
        Max().merge("e", [])
    with pytest.raises(MergeError, match="2 shards but 3 ranks"):
        Max().merged_shape("e", [(1,), (1,)], ranks=[0, 1, 2])


def test_scalar_max_picks_by_shape() -> None:
    rule = ScalarMax(Concat(0))
    assert rule.merged_shape("s", [(), ()]) == ()
    assert rule.merged_shape("s", [(1,), (1,)]) == (1,)
    assert rule.merged_shape("s", [(4,), (4,)]) == (8,)
    assert torch.equal(rule.merge("s", [torch.tensor([2.0]), torch.tensor([3.0])]), torch.tensor([3.0]))


def test_merged_spec() -> None:
    specs = [TensorSpec("w", torch.bfloat16, (2, 4)), TensorSpec("w", torch.bfloat16, (2, 4))]
    assert Concat(1).merged_spec("w", specs) == TensorSpec("w", torch.bfloat16, (2, 8))
    with pytest.raises(MergeError, match="dtypes differ"):
        Concat(1).merged_spec("w", [specs[0], TensorSpec("w", torch.float16, (2, 4))])


@pytest.mark.parametrize("rule", [Concat(0), Concat(-1), Max(), Sum(), Same(), First(), ScalarMax(Concat(1))])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.bool]
)
def test_split_then_merge_is_identity(rule, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    full = torch.randn(4, 6, generator=g)
    full = (full > 0) if dtype == torch.bool else (full * 50).to(dtype)
    shards = rule.split("t", full, 2)
    assert len(shards) == 2
    assert _bit_equal(rule.merge("t", shards, ranks=[0, 1]), full)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    parts=st.integers(1, 4),
    data=st.data(),
)
def test_concat_split_merge_property(shape: list[int], parts: int, data: st.DataObject) -> None:
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    full_shape = list(shape)
    full_shape[dim] *= parts
    full = torch.arange(float(torch.Size(full_shape).numel())).reshape(full_shape)
    rule = Concat(dim)
    pieces = rule.split("p", full, parts)
    assert rule.merged_shape("p", [tuple(p.shape) for p in pieces]) == tuple(full_shape)
    assert torch.equal(rule.merge("p", pieces), full)


def test_split_uneven_is_an_error() -> None:
    with pytest.raises(MergeError, match=r"'t'.*3 equal parts"):
        Concat(0).split("t", torch.zeros(4, 2), 3)


def test_errors_are_value_errors_of_the_hierarchy() -> None:
    assert issubclass(MergeError, ValueError) and issubclass(MergeError, DistributeError)
    assert issubclass(RuleSyntaxError, ValueError)


# --------------------------------------------------------------------------------------------------------
# Parsing, tables and rules files.


def test_parse_rule_round_trip() -> None:
    for text in ("concat:0", "concat:-1", "max", "sum", "same", "first", "scalar_max:concat:1"):
        assert str(parse_rule(text)) == text
    assert parse_rule(" MAX ") == Max()
    assert parse_rule("concat:-1") == Concat(-1)


def test_parse_rule_unknown_lists_valid_rules() -> None:
    with pytest.raises(
        RuleSyntaxError,
        match=r"unknown merge rule 'avg'.*concat:<dim>, concat:<dim>:<parts>, swiglu, max, sum",
    ):
        parse_rule("avg")
    with pytest.raises(RuleSyntaxError, match="concat:<dim>"):
        parse_rule("concat")
    with pytest.raises(RuleSyntaxError, match="concat:<dim>"):
        parse_rule("concat:x")


def test_table_first_match_wins_and_fallback() -> None:
    table = RuleTable([("*.special.weight", "max"), ("*.weight", "concat:0"), ("head.*", Sum())])
    assert table.rule_for("a.b.special.weight") == Max()
    assert table.rule_for("a.special2.weight") == Concat(0)  # '*' crosses dots
    assert table.rule_for("head.bias") == Sum()
    assert table.rule_for("Head.bias") == Same()  # case-sensitive; fallback
    assert table.match("norm.bias") == (None, Same())
    assert RuleTable(fallback="first").rule_for("anything") == First()


def test_table_then_and_to_text_round_trip() -> None:
    user = RuleTable.from_mapping({"output_layer.weight": "same"})
    combined = user.then(RuleTable.default())
    assert combined.rule_for("output_layer.weight") == Same()
    assert combined.rule_for("decoder.layers.0.mlp.linear_fc1.weight") == Concat(0)
    text = combined.to_text()
    assert RuleTable.from_text(text, fallback=Unknown()) == RuleTable(
        [*combined, ("*", Unknown())], fallback=Unknown()
    )


def test_a_users_catch_all_is_tried_after_the_defaults() -> None:
    """A ``*`` line cannot shadow the built-in rules: it decides only what nothing else names."""
    user = RuleTable.from_text("*.router.weight first\n* same\n*.extra.weight concat:1\n")
    combined = user.then(RuleTable.default())
    assert combined.match("embedding.word_embeddings.weight") == ("*.word_embeddings.weight", Concat(0))
    assert combined.rule_for("decoder.layers.0.mlp.router.weight") == First()  # named: before the defaults
    assert combined.rule_for("decoder.layers.0.extra.weight") == Concat(1)  # non-catch-alls keep their turn
    assert combined.match("something.new") == ("*", Same())  # instead of the defaults' unknown
    assert [p for p, _ in combined][-1] == "*"
    # without a catch-all the defaults' fallback stays
    assert RuleTable.from_text("*.x max\n").then(RuleTable.default()).rule_for("y") == Unknown()


def test_from_mapping_errors_name_the_pattern() -> None:
    with pytest.raises(RuleSyntaxError, match=r"pattern '\*\.w'.*unknown merge rule 'bogus'"):
        RuleTable.from_mapping({"*.w": "bogus"})
    with pytest.raises(RuleSyntaxError, match="bad pattern"):
        RuleTable([("has space", "max")])


def test_rules_file(tmp_path: Path) -> None:
    path = tmp_path / "rules.txt"
    path.write_text(
        "# my rules\n\n*.linear_qkv.weight   concat:0   # column\n  *.linear_proj.weight concat:-1\n*.amax max\n"
    )
    table = RuleTable.from_file(path)
    assert list(table) == [
        ("*.linear_qkv.weight", Concat(0)),
        ("*.linear_proj.weight", Concat(-1)),
        ("*.amax", Max()),
    ]


def test_rules_file_errors_have_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "bad.rules"
    path.write_text("# ok\n*.a max\n\n*.b avg\n")
    with pytest.raises(RuleSyntaxError, match=rf"{path}:4: unknown merge rule 'avg'; valid rules"):
        RuleTable.from_file(path)
    path.write_text("*.a max\n*.b\n")
    with pytest.raises(RuleSyntaxError, match=rf"{path}:2: expected 'PATTERN RULE'"):
        RuleTable.from_file(path)
    path.write_text("*.a max extra\n")
    with pytest.raises(RuleSyntaxError, match=rf"{path}:1:"):
        RuleTable.from_file(path)


# --------------------------------------------------------------------------------------------------------
# Default Megatron table.

CORE = "decoder.layers.3."
LEGACY = "language_model.encoder.layers.3."


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        (CORE + "self_attention.linear_qkv.weight", Concat(0)),
        (CORE + "self_attention.linear_qkv.bias", Concat(0)),
        (CORE + "self_attention.linear_proj.weight", Concat(1)),
        (CORE + "self_attention.linear_proj.bias", Same()),
        (CORE + "mlp.linear_fc1.weight", Concat(0)),
        (CORE + "mlp.linear_fc1.bias", Concat(0)),
        (CORE + "mlp.linear_fc2.weight", Concat(1)),
        (CORE + "mlp.linear_fc2.bias", Same()),
        (CORE + "input_layernorm.weight", Same()),
        (CORE + "pre_mlp_layernorm.bias", Same()),
        (CORE + "self_attention.linear_qkv.layer_norm_weight", Same()),
        (CORE + "mlp.linear_fc1.layer_norm_bias", Same()),
        ("decoder.final_layernorm.weight", Same()),
        ("embedding.word_embeddings.weight", Concat(0)),
        ("embedding.position_embeddings.weight", Same()),
        ("output_layer.weight", Concat(0)),
        (LEGACY + "self_attention.query_key_value.weight", Concat(0)),
        (LEGACY + "self_attention.query_key_value.bias", Concat(0)),
        (LEGACY + "self_attention.dense.weight", Concat(1)),
        (LEGACY + "self_attention.dense.bias", Same()),
        (LEGACY + "mlp.dense_h_to_4h.weight", Concat(0)),
        (LEGACY + "mlp.dense_h_to_4h.bias", Concat(0)),
        (LEGACY + "mlp.dense_4h_to_h.weight", Concat(1)),
        (LEGACY + "mlp.dense_4h_to_h.bias", Same()),
        (LEGACY + "input_layernorm.weight", Same()),
        ("language_model.encoder.final_layernorm.weight", Same()),
        ("language_model.embedding.word_embeddings.weight", Concat(0)),
        ("language_model.output_layer.weight", Concat(0)),
    ],
)
def test_default_table(name: str, rule) -> None:
    assert RuleTable.default().rule_for(name) == rule


def test_default_table_without_quant_has_no_scale_rules() -> None:
    assert RuleTable.default().rule_for(CORE + "mlp.linear_fc1.weight_scale") == Unknown()
    with pytest.raises(ValueError, match="unknown quant_format 'fp4'"):
        RuleTable.default("fp4")


# --------------------------------------------------------------------------------------------------------
# ModelOpt quantized rules: one assertion per fact.

VEC = (8,)
MAT = (8, 4)


def test_quant_fp8() -> None:
    assert quantized_rule("fp8", "column", "weight_scale", MAT) == Max()
    assert quantized_rule("fp8", "row", "weight_scale", MAT) == Max()
    assert quantized_rule("fp8", "column", "activation_scale", ()) == Max()
    assert quantized_rule("fp8", "row", "activation_scale", ()) == Max()


def test_quant_int8_sq_column() -> None:
    assert quantized_rule("int8_sq", "column", "weight_scale", VEC) == Concat(0)
    assert quantized_rule("int8_sq", "column", "activation_scale", VEC) == Max()
    assert quantized_rule("int8_sq", "column", "pre_quant_scale", VEC) == Same()


def test_quant_int8_sq_row() -> None:
    assert quantized_rule("int8_sq", "row", "weight_scale", VEC) == Max()
    assert quantized_rule("int8_sq", "row", "activation_scale", VEC) == Max()
    assert quantized_rule("int8_sq", "row", "pre_quant_scale", VEC) == Concat(0)


def test_quant_int4_awq_column() -> None:
    assert quantized_rule("int4_awq", "column", "weight_scale", MAT) == Concat(0)
    assert quantized_rule("int4_awq", "column", "activation_scale", ()) == Max()


def test_quant_int4_awq_row() -> None:
    assert quantized_rule("int4_awq", "row", "weight_scale", MAT) == Concat(1)
    assert quantized_rule("int4_awq", "row", "activation_scale", ()) == Max()
    assert quantized_rule("int4_awq", "row", "pre_quant_scale", VEC) == Concat(0)


@pytest.mark.parametrize("fmt", ["int8_sq", "int4_awq"])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_quant_scalar_scales_are_max(fmt: str, shape: tuple[int, ...]) -> None:
    assert quantized_rule(fmt, "column", "weight_scale", shape) == Max()
    assert quantized_rule(fmt, "row", "weight_scale", shape) == Max()
    assert quantized_rule(fmt, "row", "pre_quant_scale", shape) == Max()


@pytest.mark.parametrize("fmt", [None, "fp8", "int8_sq", "int4_awq"])
def test_quant_weights_and_biases(fmt: str | None) -> None:
    assert quantized_rule(fmt, "column", "weight", MAT) == Concat(0)
    assert quantized_rule(fmt, "row", "weight", MAT) == Concat(1)
    assert quantized_rule(fmt, "column", "bias", VEC) == Concat(0)
    assert quantized_rule(fmt, "row", "bias", VEC) == Same()


def test_quant_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown quant_format"):
        quantized_rule("nvfp4", "column", "weight_scale", VEC)
    with pytest.raises(ValueError, match="valid: column, row"):
        quantized_rule("fp8", "diagonal", "weight", VEC)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tensor kind"):
        quantized_rule("fp8", "row", "amax", VEC)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass quant_format"):
        quantized_rule(None, "row", "weight_scale", VEC)
    with pytest.raises(ValueError, match="no pre_quant_scale"):
        quantized_rule("fp8", "row", "pre_quant_scale", VEC)


@pytest.mark.parametrize(
    ("fmt", "suffix", "shape", "rule"),
    [
        ("int8_sq", "linear_qkv.weights_scaling_factor", (8,), Concat(0)),
        ("int8_sq", "linear_proj.weights_scaling_factor", (8,), Max()),
        ("int8_sq", "linear_qkv.activation_scaling_factor", (), Max()),
        ("int8_sq", "linear_qkv.input_scale", (), Max()),
        ("int8_sq", "linear_proj.prequant_scaling_factor", (8,), Concat(0)),
        ("int8_sq", "linear_qkv.prequant_scaling_factor", (8,), Same()),
        ("int4_awq", "linear_proj.weight_scale", (8, 2), Concat(1)),
        ("int4_awq", "linear_proj.weight_scale_2", (), Max()),
        ("int4_awq", "linear_qkv.weights_scaling_factor_2", (1,), Max()),
        ("fp8", "linear_qkv.weight_scale", (), Max()),
    ],
)
def test_default_table_quant_names(fmt: str, suffix: str, shape: tuple[int, ...], rule) -> None:
    table = RuleTable.default(fmt)
    for name in (CORE + "self_attention." + suffix, "x." + suffix):
        chosen = table.rule_for(name)
        assert chosen.merged_shape(name, [shape, shape]) == rule.merged_shape(name, [shape, shape])
        full = torch.rand(rule.merged_shape(name, [shape, shape]))
        parts = rule.split(name, full, 2)
        assert _bit_equal(chosen.merge(name, parts), full)


# --------------------------------------------------------------------------------------------------------
# Sharding a synthetic model and merging it back in one process.


@pytest.mark.parametrize("quant_format", [None, "fp8", "int8_sq", "int4_awq"])
def test_shard_then_merge_reproduces_original(quant_format: str | None) -> None:
    sd = make_gpt_state_dict(4, 16, 32, 24, quant_format=quant_format, awq_group_size=4)
    tp, pp, lps = 2, 2, [3, 1]
    table = RuleTable.default(quant_format)
    shards = shard_state_dict(sd, tp, pp, layers_per_stage=lps, quant_format=quant_format)
    merged: dict[str, torch.Tensor] = {}
    offsets = [0, 3]
    for p in range(pp):
        for local in shards[(0, p)]:
            name = global_layer_name(local, offsets[p])
            merged[name] = table.rule_for(name).merge(
                name, [shards[(t, p)][local] for t in range(tp)], [0, 1]
            )
    assert list(merged) == list(sd)
    for name, t in sd.items():
        assert _bit_equal(merged[name], t), name
    # TP really split something, and the scales differ across ranks where they should.
    assert shards[(0, 0)]["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == 16
    if quant_format == "fp8":
        a = shards[(0, 0)]["decoder.layers.0.mlp.linear_fc1.weight_scale"]
        b = shards[(1, 0)]["decoder.layers.0.mlp.linear_fc1.weight_scale"]
        assert not torch.equal(a, b)


# --------------------------------------------------------------------------------------------------------
# Gated MLPs (SwiGLU) and the unknown rule.


def test_swiglu_merges_gate_then_up_across_ranks() -> None:
    """Each TP rank holds [gate_t; up_t]; the merge is [gate_0; gate_1; up_0; up_1], never [g0; u0; g1; u1]."""
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    shards = [torch.cat([gate[:2], up[:2]]), torch.cat([gate[2:], up[2:]])]
    rule = parse_rule("swiglu")
    assert rule == Concat(0, 2) == parse_rule("concat:0:2") and str(rule) == "concat:0:2"
    assert torch.equal(rule.merge("fc1", shards), torch.cat([gate, up]))
    assert all(torch.equal(a, b) for a, b in zip(rule.split("fc1", torch.cat([gate, up]), 2), shards))
    runs = rule.byte_runs([tuple(s.shape) for s in shards], 4)
    placed = b"".join(shards[i].numpy().tobytes()[start : start + n] for i, start, n in runs)
    assert placed == torch.cat([gate, up]).numpy().tobytes()


@pytest.mark.parametrize("dim, parts", [(0, 1), (1, 1), (0, 2), (1, 3), (-1, 2)])
def test_concat_byte_runs_are_the_merged_bytes(dim: int, parts: int) -> None:
    rule = Concat(dim, parts)
    full = torch.randn(12, 12, 4)
    shards = rule.split("t", full, 2)
    runs = rule.byte_runs([tuple(s.shape) for s in shards], 4)
    placed = b"".join(shards[i].numpy().tobytes()[start : start + n] for i, start, n in runs)
    assert placed == rule.merge("t", shards).numpy().tobytes() == full.numpy().tobytes()


def test_concat_parts_errors() -> None:
    with pytest.raises(MergeError, match=r"2 equal blocks along dim 0"):
        Concat(0, 2).merged_shape("fc1", [(3, 4), (3, 4)])
    with pytest.raises(RuleSyntaxError, match=r"concat:<dim>:<parts>"):
        parse_rule("concat:0:0")


def test_unknown_rule_keeps_one_shard_and_refuses_several() -> None:
    one = torch.randn(3)
    assert Unknown().merge("x", [one]) is one
    with pytest.raises(MergeError, match=r"no merge rule is known for tensor 'x'.*--rules.*'x concat:0'"):
        Unknown().merged_shape("x", [(3,), (3,)])
    hinted = RuleTable.default(gated=None).rule_for("decoder.layers.0.mlp.linear_fc1.weight")
    with pytest.raises(MergeError, match=r"may be gated.*--swiglu or --no-swiglu"):
        hinted.merged_shape("decoder.layers.0.mlp.linear_fc1.weight", [(4, 2), (4, 2)])


def test_default_table_knows_replicated_and_gated_names() -> None:
    gated = RuleTable.default(gated=True)
    assert gated.rule_for(CORE + "mlp.linear_fc1.weight") == Concat(0, 2)
    assert gated.rule_for(CORE + "mlp.experts.local_experts.3.linear_fc1.weight") == Concat(0, 2)
    assert gated.rule_for(CORE + "mlp.experts.linear_fc1.weight3") == Concat(0, 2)
    assert gated.rule_for(CORE + "mlp.experts.linear_fc2.weight3") == Concat(1)
    assert RuleTable.default().rule_for(CORE + "mlp.linear_fc1.weight") == Concat(0)
    for name in (
        "input_layernorm.weight",
        "self_attention.q_layernorm.weight",
        "mlp.router.weight",
        "self_attention.linear_qkv.layer_norm_bias",
    ):
        assert gated.rule_for(CORE + name) == Same(), name
    assert gated.rule_for("embedding.position_embeddings.weight") == Same()
    assert gated.rule_for(CORE + "self_attention.some_new_thing.weight") == Unknown()
