"""Consolidation of checkpoints written by megatron-core itself, compared with Megatron's own reshard.

``scripts/megatron_checkpoints.py`` builds a real ``GPTModel`` (local layer spec, CPU, gloo) on a TP x PP
(x EP, x virtual pipeline) grid and saves it in the legacy layout (``args`` with Megatron's enums, numpy
RNG states, an optimizer) and with ``dist_checkpointing.save`` (torch_dist); the ground truth is
megatron-core's ``dist_checkpointing.load`` into the same model at TP1 x PP1 x EP1. Every consolidation
must give that state dict exactly: names, dtypes, shapes and bytes.

CI runs SwiGLU + GQA + RoPE + RMSNorm at TP2 x PP2 and MoE with EP2 (legacy and torch_dist each); the
dense, tied-embedding virtual-pipeline and uneven-pipeline cases are ``slow`` (``-m slow``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader

from distribute_utils.consolidate import (
    LayoutError,
    MergeError,
    consolidate_checkpoint,
    open_checkpoint,
)
from distribute_utils.consolidate.dcp import read_dcp_metadata

from harness import MEGATRON_SAVES, load_script, without_args

writer = load_script("megatron_checkpoints")  # its CASES; it runs as a script (it starts its ranks)

CASES = {name: spec for name, spec in MEGATRON_SAVES.items() if name != "llama"}  # (llama: test_hf_export)
SLOW = {
    "dense",
    "gqa_tied_vpp",
    "uneven",
    "moe",
}  # (swiglu, with MoE-free gated MLPs, stays in the default suite)
# Unpickling the originals with weights_only=False (to strip args) imports megatron-core, which warns.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture
def written(megatron_save: Callable[[str], Path]) -> Callable[[str], Path]:
    return megatron_save


def _load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict


def assert_same_state_dict(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(truth), (
        f"extra {sorted(set(got) - set(truth))}, missing {sorted(set(truth) - set(got))}"
    )
    for name, t in truth.items():
        g = got[name]
        assert (g.dtype, tuple(g.shape)) == (t.dtype, tuple(t.shape)), name
        assert torch.equal(
            g.contiguous().view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8)
        ), name


def _params(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.mark.parametrize("name", _params(list(CASES)))
def test_legacy_in_one_process_is_megatrons_own_reshard(written, tmp_path: Path, name: str) -> None:
    root = written(name)
    layout = open_checkpoint(root / "legacy")
    spec = CASES[name]
    assert (layout.tp, layout.pp, layout.ep) == (spec["tp"], spec["pp"], spec.get("ep", 1))
    assert layout.args is not None and layout.args.swiglu == writer.CASES[spec["case"]].get("swiglu", False)
    report = consolidate_checkpoint(root / "legacy", tmp_path, progress=False)
    assert report.world_size == 1
    assert_same_state_dict(_load(tmp_path / "model.safetensors"), _load(root / "truth.safetensors"))


@pytest.mark.parametrize("name", _params(list(CASES)))
def test_torch_dist_is_megatrons_own_reshard(written, tmp_path: Path, name: str) -> None:
    root = written(name)
    report = consolidate_checkpoint(root / "torch_dist", tmp_path, progress=False, names="local")
    assert report.layout == "megatron_torch_dist"
    # .metadata (megatron-core adds its save plans) read by the allow-list reader exactly as torch's
    # pickle.load reads it (a file this test wrote)
    theirs = FileSystemReader(str(root / "torch_dist")).read_metadata()
    theirs.storage_meta.load_id = None
    ours = read_dcp_metadata(root / "torch_dist" / ".metadata")
    assert vars(ours) == vars(theirs) and "all_local_plans" in vars(ours)
    assert_same_state_dict(_load(tmp_path / "model.safetensors"), _load(root / "truth.safetensors"))


def _consolidate_cli(src: Path, out: Path, *flags: str) -> dict:
    """``distribute-utils consolidate SRC OUT --quiet --json FLAGS`` in a fresh process; its JSON report."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distribute_utils",
            "consolidate",
            str(src),
            str(out),
            "--quiet",
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "name",
    [
        "moe",
        pytest.param("swiglu", marks=pytest.mark.slow),
        pytest.param("gqa_tied_vpp", marks=pytest.mark.slow),
    ],
)
def test_cli_consolidates_on_one_rank_per_shard(written, tmp_path: Path, name: str) -> None:
    """The command users run, with one local rank per shard (TP x PP x EP): the distributed driver
    (TP groups merge, stages stream to rank 0 through shared memory) on the real files."""
    root = written(name)
    spec = CASES[name]
    world = spec["tp"] * spec["pp"] * spec.get("ep", 1)
    out = tmp_path / "out"
    report = _consolidate_cli(root / "legacy", out, "--nproc", str(world))
    assert report["world_size"] == world
    assert_same_state_dict(_load(out / "model.safetensors"), _load(root / "truth.safetensors"))


def test_cli_default_is_one_process_for_both_formats(written, tmp_path: Path) -> None:
    root = written("swiglu")
    truth = _load(root / "truth.safetensors")
    for fmt, extra in (("legacy", []), ("torch_dist", ["--megatron-names", "local"])):
        out = tmp_path / fmt
        assert _consolidate_cli(root / fmt, out, *extra)["world_size"] == 1
        assert_same_state_dict(_load(out / "model.safetensors"), truth)


def test_legacy_files_load_without_megatron_and_run_no_pickled_code(written) -> None:
    """args (Namespace with Megatron's enums, signal.Signals), numpy RNG states: read in a fresh
    interpreter where megatron is not importable, with no module imported from the checkpoint."""
    root = written("swiglu")
    shard = open_checkpoint(root / "legacy").file_for(1, 1)
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "from distribute_utils.consolidate import open_checkpoint\n"
        f"layout = open_checkpoint({str(root / 'legacy')!r})\n"
        "sd = layout.load_shard(1, 1)\n"
        "from distribute_utils.consolidate.safe_load import safe_torch_load\n"
        f"obj = safe_torch_load({str(shard)!r})\n"
        "print(layout.args.tp, layout.args.pp, layout.args.swiglu, repr(obj['args'].model_type), "
        "obj['args'].exit_signal.name, type(obj['rng_state'][0]['np_rng_state'][1]).__name__, len(sd), "
        "any(m.startswith('megatron') for m in sys.modules if sys.modules[m] is not None), sep='|')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tp, pp, swiglu, model_type, sig, rng, count, imported = out.stdout.strip().split("|")
    assert (tp, pp, swiglu) == ("2", "2", "True")
    assert model_type.startswith("<megatron.core.enums.ModelType")
    assert (sig, rng, imported) == ("SIGTERM", "ndarray", "False")
    assert int(count) > 0


def test_without_args_a_split_fc1_is_an_error_naming_the_fix(written, tmp_path: Path) -> None:
    """The same files with args removed: a gated and a plain MLP cannot be told apart, so no guess."""
    root = written("swiglu")
    copy = without_args(root / "legacy", tmp_path / "noargs")
    with pytest.raises(MergeError, match=r"linear_fc1\.weight.*may be gated.*--swiglu or --no-swiglu"):
        consolidate_checkpoint(copy, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    consolidate_checkpoint(copy, tmp_path / "out", progress=False, swiglu=True)
    assert_same_state_dict(_load(tmp_path / "out" / "model.safetensors"), _load(root / "truth.safetensors"))


def test_moe_without_args_is_refused_not_guessed(written, tmp_path: Path) -> None:
    """mp_rank_TT_NNN of an MoE model is TP x PP or TP x EP; without args that is an error."""
    root = written("moe")
    copy = without_args(root / "legacy", tmp_path / "noargs")
    with pytest.raises(LayoutError, match=r"TP x PP or TP x EP.*no args"):
        open_checkpoint(copy)
