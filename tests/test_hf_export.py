"""``--to hf``: real megatron-core saves consolidated straight to a Hugging Face checkpoint.

The writer is megatron-core itself (``scripts/megatron_checkpoints.py``: a Llama-style ``GPTModel`` on
CPU/gloo, saved legacy and torch_dist at TP2 x PP2), the reader transformers' ``AutoModelForCausalLM``;
the proof is numerical: the converted model's logits on a fixed batch against megatron-core's own forward
of the same weights (``logits.pt``, written with the save).

Tolerance: both forwards run in float32 on the same weights, but not the same arithmetic (one fused QKV
matmul against three, Megatron's ``baddbmm`` attention against transformers' SDPA, RoPE computed each
way), so logits agree to float32 round-off, not bit for bit: about ``2**-23`` relative per operation,
grown over 4 layers of matmuls with 64-wide sums. Measured: 2.4e-7 for logits of magnitude 1.4; the bound
``1e-5 * max(1, |logits|)`` is 40x that and 1000x below what one wrong weight does (a swapped q/k/v group,
an untrimmed row, a gate and up exchanged move logits by 1e-2 or more).

Cases: ``swiglu`` (GQA, 2 query groups of 2 heads, tied embeddings, TP2 x PP2) in the default suite, as
legacy through the command line and as torch_dist through the API; ``llama`` (untied output layer, plain
multi-head attention, llama3 RoPE scaling) is ``slow``.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from distribute_utils.consolidate import ConversionError, MergeError, consolidate_checkpoint

from harness import without_args

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

TOLERANCE = 1e-5


def load_hf(path: Path) -> tuple[Any, dict[str, Any], str]:
    """``AutoModelForCausalLM.from_pretrained(path)`` offline; the model, its loading info and every
    warning transformers logged or raised while loading."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = AutoModelForCausalLM.from_pretrained(
                str(path), output_loading_info=True, local_files_only=True
            )
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    return model, info, said.getvalue() + "".join(str(w.message) for w in caught)


def assert_megatrons_logits(out: Path, save: Path, vocab: int | None = None) -> None:
    """The converted model loads with no missing, unexpected or mismatched weight and no warning, and its
    logits on Megatron's batch are Megatron's (the first ``vocab`` of them when trimmed)."""
    model, info, said = load_hf(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
        info
    )
    assert "weight" not in said.lower() and "missing" not in said.lower(), said
    ref = torch.load(save / "logits.pt")
    model.eval()
    with torch.no_grad():
        got = model(ref["ids"]).logits
    truth = ref["logits"][..., : vocab or ref["logits"].shape[-1]]
    assert got.shape == truth.shape
    err = (got - truth).abs().max().item()
    assert err <= TOLERANCE * max(1.0, truth.abs().max().item()), err


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distribute_utils", "consolidate", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_legacy_gqa_tied_to_hf_on_the_command_line(
    megatron_save: Callable[[str], Path], tmp_path: Path
) -> None:
    """TP2 x PP2, GQA, tied: the command users run, the padded vocabulary trimmed to the tokenizer's,
    the end token given; the report says what was split and trimmed."""
    save = megatron_save("swiglu")
    out = tmp_path / "hf"
    proc = cli(
        str(save / "legacy"), str(out), "--to", "hf", "--hf-config", "vocab_size=100", "--hf-config",
        "eos_token_id=2", "--quiet", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["converted"]
    assert report["architecture"] == "LlamaForCausalLM" and len(report["renamed"]) == 18
    assert len(report["split"]) == 8 and "decoder.layers.3.self_attention.linear_qkv.weight -> " in "\n".join(
        report["split"]
    )
    assert report["trimmed"] == ["embedding.word_embeddings.weight: 128 -> 100 rows"]
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["num_attention_heads"], config["tie_word_embeddings"]) == (
        2,
        4,
        True,
    )
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 2}
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert_megatrons_logits(out, save, vocab=100)


def test_torch_dist_to_hf_sharded(megatron_save: Callable[[str], Path], tmp_path: Path) -> None:
    """The same model as megatron-core's torch_dist wrote it, through the API, into several files with an
    index: transformers loads them as one model."""
    save = megatron_save("swiglu")
    report = consolidate_checkpoint(
        save / "torch_dist", tmp_path, to="hf", max_shard_size="100KB", progress=False
    )
    assert report.converted is not None and report.converted["trimmed"] == []
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(report.files) > 3
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] is None and config["bos_token_id"] is None, (
        "no token id given: none assumed"
    )
    assert not (tmp_path / "generation_config.json").exists()
    assert_megatrons_logits(tmp_path, save)
    # TransformerEngine's names for the same norms (linear_qkv.layer_norm_weight, linear_fc1.layer_norm_weight)
    te = tmp_path / "te"
    consolidate_checkpoint(save / "torch_dist", te, to="hf", names="te", progress=False)
    assert_megatrons_logits(te, save)


def test_facts_the_checkpoint_lacks_are_asked_for_never_guessed(
    megatron_save: Callable[[str], Path], tmp_path: Path
) -> None:
    """Without args, the tensors give sizes and layers but not heads, epsilon, RoPE: each is named and
    asked of the command line; given, the model is Megatron's. Nothing is written while refused."""
    save = megatron_save("swiglu")
    copy = without_args(save / "legacy", tmp_path / "noargs")
    out = tmp_path / "hf"
    with pytest.raises(MergeError, match=r"pass --swiglu or --no-swiglu"):
        consolidate_checkpoint(copy, out, to="hf", progress=False)
    with pytest.raises(ConversionError, match=r"Llama's MLP is SwiGLU; --no-swiglu was given"):
        consolidate_checkpoint(copy, out, to="hf", swiglu=False, progress=False)
    proc = cli(str(copy), str(out), "--to", "hf", "--swiglu")
    assert proc.returncode == 1, proc.stderr
    for key in (
        "hidden_act",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
    ):
        assert key in proc.stderr, proc.stderr
    assert "--hf-config KEY=VALUE" in proc.stderr and not out.exists()
    given = [
        "hidden_act=silu", "num_attention_heads=4", "num_key_value_heads=2", "rms_norm_eps=1e-5", "rope_theta=10000",
        "rope_scaling=null", "max_position_embeddings=32",
    ]  # fmt: skip
    proc = cli(str(copy), str(out), "--to", "hf", "--swiglu", "--quiet", *(f"--hf-config={g}" for g in given))
    assert proc.returncode == 0, proc.stderr
    assert_megatrons_logits(out, save)


@pytest.mark.parametrize(
    "given, says",
    [
        ({"num_attention_heads": 8}, r"num_attention_heads=8 contradicts the checkpoint, which says 4"),
        ({"vocab_size": 200}, r"vocab_size 200: the embedding has 128 rows; give 1 to 128"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu': Llama's MLP is SwiGLU, its activation silu"),
        ({"rope_type": "yarn"}, r"rope_type: not a key this converter takes; valid: hidden_act"),
    ],
)
def test_a_contradicted_or_unknown_fact_is_refused_before_anything_is_written(
    megatron_save: Callable[[str], Path], tmp_path: Path, given: dict[str, Any], says: str
) -> None:
    save = megatron_save("swiglu")
    with pytest.raises(ConversionError, match=says):
        consolidate_checkpoint(save / "legacy", tmp_path / "hf", to="hf", hf_config=given, progress=False)
    assert not (tmp_path / "hf").exists()


def test_what_llama_has_no_place_for_is_refused_naming_it(tmp_path: Path) -> None:
    """A GPT with biases and learned positions (a synthetic Megatron legacy save): refused naming the
    first tensor Llama has no place for; a non-Megatron checkpoint is refused naming its kind."""
    from distribute_utils.consolidate import write_own_layout
    from distribute_utils.consolidate.megatron import write_megatron_legacy
    from distribute_utils.consolidate.synthetic import make_gpt_state_dict, shard_state_dict

    full = make_gpt_state_dict(num_layers=2, hidden=16, ffn_hidden=32, vocab=64)
    shards = shard_state_dict(full, tp=1, pp=1)
    write_megatron_legacy(tmp_path / "gpt", shards, swiglu=True)
    with pytest.raises(
        ConversionError, match=r"tensor '.*' is (a bias|learned absolute positions|a LayerNorm)"
    ):
        consolidate_checkpoint(tmp_path / "gpt", tmp_path / "hf", to="hf", progress=False)
    write_own_layout(tmp_path / "own", shards)
    with pytest.raises(
        ConversionError, match=r"converts Megatron GPT checkpoints .* this is a own checkpoint"
    ):
        consolidate_checkpoint(tmp_path / "own", tmp_path / "hf", to="hf", progress=False)
    assert not (tmp_path / "hf").exists()
    proc = cli(str(tmp_path / "gpt"), str(tmp_path / "hf"), "--to", "hf", "--format", "torch")
    assert proc.returncode == 2 and "safetensors" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("form, nproc", [("legacy", 4), ("torch_dist", 1)])
def test_llama3_untied_to_hf(
    megatron_save: Callable[[str], Path], tmp_path: Path, form: str, nproc: int
) -> None:
    """Untied output layer, plain multi-head attention, llama3 RoPE scaling from the args; legacy on one
    rank per shard (the distributed driver), torch_dist in one process."""
    save = megatron_save("llama")
    proc = cli(str(save / form), str(tmp_path), "--to", "hf", "--nproc", str(nproc), "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)["converted"]["config"]
    assert (
        config["tie_word_embeddings"] is False
        and config["num_key_value_heads"] == config["num_attention_heads"]
    )
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == 8.0
    assert_megatrons_logits(tmp_path, save)


def test_the_command_line_names_every_key_hf_config_takes() -> None:
    """``consolidate --help`` lists every key ``--hf-config`` takes (the parser imports no torch, so it
    names them itself)."""
    from distribute_utils.consolidate.hf_llama import GIVEN_KEYS

    shown = cli("--help").stdout
    assert all(key in shown for key in GIVEN_KEYS), [k for k in GIVEN_KEYS if k not in shown]
