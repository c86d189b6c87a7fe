"""torch.distributed.checkpoint input: plain DCP key for key, chunk placement, what is left out."""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import random
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from distribute_utils.cli import main
from distribute_utils.consolidate import (
    DcpCheckpoint,
    LayoutError,
    UnsafeCheckpointError,
    consolidate_checkpoint,
    load_safetensors,
    open_checkpoint,
)
from distribute_utils.consolidate.dcp import byte_runs, read_dcp_metadata

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


def testbyte_runs_place_every_box_exactly() -> None:
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
        for dst, start, n in byte_runs(shape, offsets, sizes, 2):
            out[dst : dst + n] = src[start : start + n]
        assert bytes(out) == _bits(expected).numpy().tobytes(), (shape, offsets, sizes)


def testbyte_runs_are_as_few_as_the_box_allows() -> None:
    assert byte_runs((4, 6), (2, 0), (2, 6), 4) == [(48, 0, 48)]  # rows: one run
    assert len(byte_runs((4, 6), (0, 3), (4, 3), 4)) == 4  # columns: one run per row
    assert byte_runs((), (), (), 8) == [(0, 0, 8)]


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
        ckpt = DcpCheckpoint(tmp_path / "ckpt", names=names)
        region = ckpt.region("decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight")
        assert (region.key, region.index) == ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 1))
        assert ckpt.region("decoder.final_layernorm.weight").index == ()


# ----------------------------------------------------------------------------------------------------------
# .metadata is a pickle: only DCP's own classes are built, a crafted one is refused and never runs.


def _same_metadata(root: Path) -> None:
    """read_dcp_metadata gives what torch's own reader (plain pickle.load: files written here) gives."""
    theirs = FileSystemReader(str(root)).read_metadata()
    theirs.storage_meta.load_id = None
    ours = read_dcp_metadata(root / ".metadata")
    assert type(ours) is type(theirs) and vars(ours) == vars(theirs)


def test_real_dcp_metadata_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    """Everything a DCP save puts in .metadata (tensor and bytes entries, every dtype, scalars, empty and
    nested entries, a str or a Path checkpoint_id, planner data) is rebuilt by the allow-list reader."""
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.bool,
    ]
    dtypes += [torch.int16, torch.int32, torch.int64, torch.complex64, torch.float8_e4m3fn]
    sd = {
        "model": {f"t{i}": torch.zeros(3, 2, dtype=d) for i, d in enumerate(dtypes)},
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 7),
        "blob": io.BytesIO(b"x"),
        "step": 7,
        "names": ["a", "b"],
    }
    dcp.save(sd, checkpoint_id=tmp_path / "path_id")
    dcp.save(sd, checkpoint_id=str(tmp_path / "str_id"))
    for root in (tmp_path / "path_id", tmp_path / "str_id"):
        _same_metadata(root)


class _Runs:
    """Pickles as the call ``func(*args)``: what a crafted .metadata does when it is unpickled."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def _crafted(root: Path, how: str, marker: Path) -> str:
    """Replaces a real checkpoint's .metadata with one that writes ``marker`` when unpickled; returns the
    global it names, as the pickle spells it."""
    code = f"open({str(marker)!r}, 'w').write('ran')"
    meta = root / ".metadata"
    if how == "class_change":  # a BUILD on DCP's Metadata class itself: sets Metadata.planted for the process
        meta.write_bytes(b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N}S'planted'\nI1\nstb.")
        return "a change to Metadata"
    with meta.open("rb") as f:
        md = pickle.load(f)  # the real metadata, written by this test: trusted
    payload = {
        "exec_in_planner_data": _Runs(exec, code),
        "os_system_in_storage_meta": _Runs(os.system, f"touch {marker}"),
        "whole_file": _Runs(exec, code),
    }[how]
    if how == "exec_in_planner_data":
        md.planner_data["w"] = payload
    elif how == "os_system_in_storage_meta":
        md.storage_meta.modules.append(payload)
    else:
        md = payload
    meta.write_bytes(pickle.dumps(md))
    return f"{os.system.__module__}.system" if how.startswith("os_system") else "builtins.exec"


CRAFTED = ["exec_in_planner_data", "os_system_in_storage_meta", "whole_file", "class_change"]


@pytest.mark.parametrize("how", CRAFTED)
def test_crafted_metadata_is_refused_and_never_runs(tmp_path: Path, how: str) -> None:
    """A .metadata that runs code (a __reduce__ to exec or os.system, anywhere in the file) or changes
    DCP's classes is refused, naming the file and the global, before any of it runs."""
    root, marker = tmp_path / "ckpt", tmp_path / "ran"
    dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(root))
    named = _crafted(root, how, marker)
    meta = root / ".metadata"
    with pytest.raises(UnsafeCheckpointError) as info:
        consolidate_checkpoint(root, tmp_path / "out", progress=False)
    message = str(info.value)
    assert f"'{meta}'" in message and named in message and "\n" not in message, message
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert not hasattr(Metadata, "planted")
    with pytest.raises(UnsafeCheckpointError, match=re.escape(named)):
        read_dcp_metadata(meta)
    assert not marker.exists() and not hasattr(Metadata, "planted")


@pytest.mark.parametrize("how", ["exec_in_planner_data", "os_system_in_storage_meta"])
def test_crafted_metadata_through_the_command(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``distribute-utils consolidate`` on a plain DCP and on a Megatron torch_dist directory with a crafted
    .metadata: one line naming the file and the global, exit 1, nothing run, nothing written."""
    for kind in ("dcp", "torch_dist"):
        root, marker, out = tmp_path / kind, tmp_path / f"ran_{kind}", tmp_path / f"out_{kind}"
        dcp.save({"decoder.layers.mlp.linear_fc1.weight": torch.ones(2, 4, 4)}, checkpoint_id=str(root))
        if kind == "torch_dist":
            (root / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        named = _crafted(root, how, marker)
        try:
            code = main(["consolidate", str(root), str(out), "-q", "--json"])
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert code == 1 and len(lines) == 1, captured.err
        assert f"'{root / '.metadata'}'" in lines[0] and named in lines[0] and "Traceback" not in captured.err
        error = json.loads(captured.out)
        assert error["exit_code"] == 1 and named in error["error"]
        assert not marker.exists() and not out.exists()
