"""torch.distributed.checkpoint input: plain DCP key for key, chunk placement, what is left out."""

from __future__ import annotations

import io
import itertools
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distribute_utils.consolidate import (
    DcpCheckpoint,
    LayoutError,
    consolidate_checkpoint,
    load_safetensors,
    open_checkpoint,
)
from distribute_utils.consolidate.dcp import _byte_runs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_plain_dcp_is_written_key_for_key(tmp_path: Path) -> None:
    """A single-process DCP save (as FSDP/torchtitan write for one rank): every tensor, any dtype, nested
    keys flattened as DCP flattens them; bytes entries left out; nothing else."""
    sd = {
        "model": {
            "tok_embeddings.weight": torch.randn(16, 8, dtype=torch.bfloat16),
            "layers.0.attention.wq.weight": torch.randn(8, 8),
            "norm.weight": torch.arange(8, dtype=torch.int32),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
        },
        "extra": io.BytesIO(b"not a tensor"),
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    ckpt = open_checkpoint(tmp_path / "ckpt")
    assert isinstance(ckpt, DcpCheckpoint) and ckpt.kind == "dcp"
    report = consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert report.layout == "dcp" and report.world_size == 1
    got = load_safetensors(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(f"model.{k}" for k in sd["model"])
    for k, t in sd["model"].items():
        g = got[f"model.{k}"]
        assert (g.dtype, g.shape) == (t.dtype, t.shape) and torch.equal(_bits(g), _bits(t)), k


def test_dcp_torch_output_and_batches(tmp_path: Path) -> None:
    """The torch.save writer path reads whole tensors batch by batch; tiny batches change nothing."""
    sd = {f"w{i}": torch.randn(33, 7) for i in range(5)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    consolidate_checkpoint(
        tmp_path / "ckpt", tmp_path / "out", progress=False, format="torch", batch_bytes=100
    )
    got = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


def test_byte_runs_place_every_box_exactly() -> None:
    """Any sub-box of a row-major tensor: the runs put the box's bytes exactly where indexing says."""
    rng = random.Random(7)
    for _ in range(200):
        ndim = rng.randint(0, 4)
        shape = tuple(rng.randint(1, 5) for _ in range(ndim))
        offsets = tuple(rng.randint(0, n - 1) for n in shape)
        sizes = tuple(rng.randint(1, n - o) for n, o in zip(shape, offsets))
        full = torch.zeros(shape, dtype=torch.int16)
        box = torch.arange(
            1, 1 + max(1, int(torch.tensor(sizes).prod().item()) if sizes else 1), dtype=torch.int16
        )
        box = box.reshape(sizes)
        expected = full.clone()
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        expected[index] = box
        out = bytearray(_bits(full).numpy().tobytes())
        src = _bits(box).numpy().tobytes()
        for dst, start, n in _byte_runs(shape, offsets, sizes, 2):
            out[dst : dst + n] = src[start : start + n]
        assert bytes(out) == _bits(expected).numpy().tobytes(), (shape, offsets, sizes)


def test_byte_runs_are_as_few_as_the_box_allows() -> None:
    assert _byte_runs((4, 6), (2, 0), (2, 6), 4) == [(48, 0, 48)]  # rows: one run
    assert len(_byte_runs((4, 6), (0, 3), (4, 3), 4)) == 4  # columns: one run per row
    assert _byte_runs((), (), (), 8) == [(0, 0, 8)]


def test_not_a_dcp_directory_and_bad_options(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(LayoutError, match=r"\.metadata: not readable DCP metadata"):
        open_checkpoint(tmp_path)
    sd = {"w": torch.ones(2)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ok"))
    with pytest.raises(LayoutError, match="layers_per_stage does not apply"):
        open_checkpoint(tmp_path / "ok", layers_per_stage=[1])
    with pytest.raises(ValueError, match="names must be one of te, local"):
        DcpCheckpoint(tmp_path / "ok", names="hf")


def test_missing_chunk_file_is_an_error_not_a_hole(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(tmp_path / "ckpt"))
    for f in (tmp_path / "ckpt").glob("*.distcp"):
        f.unlink()
    with pytest.raises(FileNotFoundError):
        consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").glob("*.safetensors")) if (tmp_path / "out").exists() else True


def test_megatron_stacked_names_without_megatron(tmp_path: Path) -> None:
    """Megatron's sharded-key conventions, on a hand-made torch_dist directory: stacked layers and
    experts are split out per index, layer norms renamed for the local spec, _extra_state and optimizer
    entries left out."""
    layers, experts = 3, 2
    sd = {
        "embedding.word_embeddings.weight": torch.randn(10, 4),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(layers, 4),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": torch.randn(layers, experts, 6, 4),
        "decoder.final_layernorm.weight": torch.randn(4),
        "optimizer.state.exp_avg.decoder.final_layernorm.weight": torch.randn(4),
        "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1": io.BytesIO(b"x"),
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    for names, norm in (
        ("te", "self_attention.linear_qkv.layer_norm_weight"),
        ("local", "input_layernorm.weight"),
    ):
        out = tmp_path / names
        report = consolidate_checkpoint(tmp_path / "ckpt", out, progress=False, names=names)
        assert report.layout == "megatron_torch_dist"
        got = load_safetensors(out / "model.safetensors")
        expected = {
            "embedding.word_embeddings.weight": sd["embedding.word_embeddings.weight"],
            "decoder.final_layernorm.weight": sd["decoder.final_layernorm.weight"],
        }
        for layer, e in itertools.product(range(layers), range(experts)):
            expected[f"decoder.layers.{layer}.{norm}"] = sd[
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
            ][layer]
            expected[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = sd[
                "decoder.layers.mlp.experts.experts.linear_fc1.weight"
            ][layer, e]
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
