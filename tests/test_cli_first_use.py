"""The command line as a new user meets it: wrong paths answered at once in one line naming the real
cause (before torch is imported), a DCP checkpoint's training state listed instead of dropped without a
word, only the model written and loadable into the bare module, and plain words for --nproc on DCP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from distribute_utils.cli import main

_NO_TORCH = (
    "import sys\n"
    "from distribute_utils.cli import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit as exc:\n"
    "    print('exit', exc.code, 'torch' in sys.modules)\n"
)


def _usage_error(*argv: str, cwd: Path) -> str:
    """Runs the command in a fresh interpreter: its one stderr line (exit 2, torch never imported)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, "consolidate", *argv], capture_output=True, text=True, cwd=cwd
    )
    took = time.monotonic() - start
    assert proc.stdout == "exit 2 False\n", (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("distribute-utils consolidate: error: ")
    assert lines[0].endswith("(see 'distribute-utils consolidate --help')")
    assert took < 20, took  # (generous: a shared machine; without torch it is about 0.1 s)
    return lines[0]


def _dcp_with_training_state(root: Path) -> torch.nn.Linear:
    """A DCP checkpoint as a training loop saves one: model, optimizer, a torchtitan-style train_state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "train_state": {"step": 7, "run_name": "a", "nested": {"k": 1}}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(root))
    return model


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    _dcp_with_training_state(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_wrong_paths_are_one_line_naming_the_real_cause_before_torch(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    said = {
        "missing input": _usage_error("nope", "out", cwd=tmp_path),
        "parent is a file": _usage_error(str(ckpt), "afile/out/", cwd=tmp_path),
        "proc": _usage_error(str(ckpt), "/proc/out/", cwd=tmp_path),
        "inside the input": _usage_error(str(ckpt), str(ckpt / "out"), cwd=tmp_path),
        "argparse": _usage_error("--bogus", cwd=tmp_path),
        "nproc on DCP": _usage_error(str(ckpt), "out", "--nproc", "4", cwd=tmp_path),
    }
    assert "input 'nope' does not exist" in said["missing input"]
    assert f"('{tmp_path / 'afile'}') is a file, not a directory" in said["parent is a file"]
    assert "'/proc' is on a filesystem that holds no files" in said["proc"]
    assert f"is inside the input checkpoint '{ckpt}'" in said["inside the input"]
    assert "unrecognized arguments: --bogus" in said["argparse"] or "required" in said["argparse"]
    assert (
        "which one process consolidates" in said["nproc on DCP"]
        and "leave out --nproc" in said["nproc on DCP"]
    )
    assert not (ckpt / "out").exists() and not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare (a mount namespace)")
def test_a_read_only_output_is_named_before_anything_is_written(ckpt: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    script = f'mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -c "$0" consolidate {ckpt} {ro}/out'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, _NO_TORCH], capture_output=True, text=True)
    assert proc.stdout == "exit 2 False\n", (proc.stdout, proc.stderr)
    assert f"output '{ro}/out': '{ro}' is on a read-only filesystem" in proc.stderr
    assert ".tmp-" not in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_nproc_on_a_dcp_checkpoint_is_answered_in_plain_words(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["consolidate", str(ckpt), str(tmp_path / "out"), "--nproc", "4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "which one process consolidates" in err and "leave out --nproc" in err, err
    assert "needs 1 ranks" not in err


def test_training_state_is_listed_never_dropped_without_a_word(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["consolidate", str(ckpt), str(tmp_path / "out"), "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    left = dict(report["left_out"])
    for key in (
        "train_state.step",
        "train_state.run_name",
        "train_state.nested.k",
        "optim.param_groups.0.lr",
    ):
        assert left.get(key) == "not a tensor", (key, left)
    assert report["tensors"] == len(load_file(tmp_path / "out" / "model.safetensors"))
    assert main(["consolidate", str(ckpt), str(tmp_path / "out2"), "-q"]) == 0
    text = capsys.readouterr().out
    assert "left out:   " in text and "not a tensor (optim.param_groups.0.lr" in text, text


def test_only_the_model_with_its_prefix_stripped_loads_into_the_bare_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _dcp_with_training_state(tmp_path / "ckpt")
    out = tmp_path / "out"
    argv = ["consolidate", str(tmp_path / "ckpt"), str(out), "--only", "model.", "--strip-prefix", "model."]
    assert main([*argv, "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {why for _, why in report["left_out"]} == {"not a tensor", "not under --only model."}
    bare = torch.nn.Linear(4, 3)
    bare.load_state_dict(load_file(out / "model.safetensors"), strict=True)  # every key, no other
    for name, tensor in model.state_dict().items():
        assert torch.equal(bare.state_dict()[name], tensor), name
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--only", "nothing."]) == 1
    assert "--only 'nothing.' keeps none of the 8 tensors; their names start with model., optim." in (
        capsys.readouterr().err
    )


def test_dry_run_shows_a_rule_for_dcp_tensors(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["consolidate", str(ckpt), "unused", "--dry-run", "--only", "model."]) == 0
    out = capsys.readouterr().out
    assert "model.weight  whole" in out and "unknown" not in out, out
