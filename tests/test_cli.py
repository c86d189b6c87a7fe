"""The ``distribute-utils`` command line: help, usage errors (exit 2), one-line failures (exit 1), real runs.

Most cases run ``main(argv)`` in this process (errors are found before any rank is spawned; ``--nproc 1``
consolidates in-process); a few run the real command: spawning ranks, under ``torchrun``, the demo, and a
full disk in a private mount namespace (root only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distribute_utils.cli import build_parser, main
from distribute_utils.consolidate import load_safetensors, write_own_layout
from distribute_utils.consolidate.megatron import write_megatron_legacy
from distribute_utils.consolidate.synthetic import make_gpt_state_dict, shard_state_dict

from harness import torchrun_argv

LPS = [3, 1]

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare to mount a private small tmpfs",
)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distribute_utils", *args], capture_output=True, text=True, timeout=timeout
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name


def _load_dir(out: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("*.safetensors")):
        found.update(load_safetensors(path))
    return found


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture(scope="module")
def model() -> dict[str, torch.Tensor]:
    return make_gpt_state_dict(num_layers=4, hidden=64, ffn_hidden=256, vocab=512, seed=11)


@pytest.fixture(scope="module")
def ckpt(model: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    write_own_layout(root, shard_state_dict(model, 2, 2, layers_per_stage=LPS), layers_per_stage=LPS)
    return root


# --------------------------------------------------------------------------------------------------------
# Help.


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **action.choices}


@pytest.mark.parametrize("command", ["", "consolidate", "demo"])
def test_help_exits_0_and_mentions_every_option(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = _subparsers()[command]
    assert _exit_code([*([command] if command else []), "--help"]) == 0
    out = capsys.readouterr().out
    for action in parser._actions:
        for option in action.option_strings:
            assert option in out, f"{option} missing from `{command} --help`"
        if not action.option_strings and action.dest != "command":
            assert action.metavar in out
    if command == "consolidate":
        for text in (
            "mesh.json",
            "mp_rank_TT[_PPP][_EEE]",
            ".metadata",
            "exit codes",
            "usage error",
            "default safetensors",
            "torchrun",
        ):
            assert text in out, text
    if command == "":
        assert "consolidate" in out and "demo" in out


# --------------------------------------------------------------------------------------------------------
# Usage errors: exit code 2, before any rank is spawned.


def test_usage_errors_exit_2(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "--nproc 3 does not fit": ["consolidate", str(ckpt), out, "--nproc", "3"],
        "bad size '12XB': unknown unit 'XB'": ["consolidate", str(ckpt), out, "--max-shard-size", "12XB"],
        "is not a checkpoint": ["consolidate", str(empty), out],
        "does not exist": ["consolidate", str(tmp_path / "nope"), out],
        "expected a positive number of seconds": ["consolidate", str(ckpt), out, "--timeout", "-1"],
        "invalid choice: 'npz'": ["consolidate", str(ckpt), out, "--format", "npz"],
        "--tp 2 x --pp 2 = 4, but --nproc is 3": ["demo", "--nproc", "3"],
    }
    rules = tmp_path / "bad.rules"
    rules.write_text("*.weight avg\n")
    cases["bad.rules:1: unknown merge rule 'avg'"] = ["consolidate", str(ckpt), out, "--rules", str(rules)]
    for expected, argv in cases.items():
        assert _exit_code(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err, (argv, err)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------
# Failures: exit code 1 and one line naming the cause.


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("distribute-utils consolidate: error: ")
    return lines[0]


def test_missing_shard_file_is_named(
    model: dict[str, torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = tmp_path / "in"
    write_own_layout(inp, shard_state_dict(model, 2, 2, layers_per_stage=LPS), layers_per_stage=LPS)
    (inp / "rank_00002.safetensors").unlink()
    assert _exit_code(["consolidate", str(inp), str(tmp_path / "out"), "-q"]) == 1
    line = _one_error_line(capsys)
    assert f"'{inp / 'rank_00002.safetensors'}'" in line and "(TP rank 0, stage 1) is missing" in line


def test_shape_mismatch_names_tensor_and_ranks(
    model: dict[str, torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = shard_state_dict(model, 2, 2, layers_per_stage=LPS)
    shards[(1, 0)]["decoder.layers.1.self_attention.linear_qkv.weight"] = torch.zeros(
        96, 63, dtype=torch.bfloat16
    )
    inp = tmp_path / "in"
    write_own_layout(inp, shards, layers_per_stage=LPS)
    assert _exit_code(["consolidate", str(inp), str(tmp_path / "out"), "-q"]) == 1
    line = _one_error_line(capsys)
    assert "tensor 'decoder.layers.1.self_attention.linear_qkv.weight'" in line
    assert "rank 0: (96, 64), rank 1: (96, 63)" in line and "TP rank 1 = global rank 1" in line


def test_data_mismatch_in_process_exit_1(
    model: dict[str, torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = shard_state_dict(model, 2, 2, layers_per_stage=LPS)
    norm = "decoder.final_layernorm.bias"
    shards[(1, 1)][norm] = shards[(1, 1)][norm] + 1
    inp, out = tmp_path / "in", tmp_path / "out"
    write_own_layout(inp, shards, layers_per_stage=LPS)
    assert _exit_code(["consolidate", str(inp), str(out), "--nproc", "1", "-q"]) == 1
    line = _one_error_line(capsys)
    assert f"tensor '{norm}' is replicated" in line and "rank 3 differs from rank 2:" in line
    assert "give it a rule" not in line and "TP rank 1 = global rank 3 in" in line  # (its files named)
    assert not out.exists()  # nothing left, not even the folder the run created


# --------------------------------------------------------------------------------------------------------
# Successful runs.


def test_nproc_1_in_process_torch_format(
    model: dict[str, torch.Tensor], ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert (
        _exit_code(["consolidate", str(ckpt), str(out), "--nproc", "1", "--format", "torch", "-q", "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 1 and report["format"] == "torch"
    _assert_bit_exact(torch.load(out / "pytorch_model.bin", weights_only=True), model)


def test_consolidate_spawns_ranks(
    model: dict[str, torch.Tensor], ckpt: Path, tmp_path: Path, no_shm_leak: None
) -> None:
    out = tmp_path / "out"
    proc = _cli(
        "consolidate", str(ckpt), str(out), "--nproc", "4", "--max-shard-size", "200KB", "--quiet", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["world_size"] == 4 and report["transport"] == "shm" and report["tensors"] == len(model)
    assert report["files"][-1] == str(out / "model.safetensors.index.json")
    assert report["peak_rss_bytes"] > 0
    _assert_bit_exact(_load_dir(out), model)
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr.lower(), proc.stderr


def test_consolidate_under_torchrun_megatron(
    model: dict[str, torch.Tensor], tmp_path: Path, no_shm_leak: None
) -> None:
    inp, out = tmp_path / "meg", tmp_path / "out"
    write_megatron_legacy(inp, shard_state_dict(model, 2, 2, layers_per_stage=LPS), iteration=50)
    cmd = torchrun_argv(4, "-m", "distribute_utils", "consolidate", str(inp), str(out), "--quiet", "--json")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # only rank 0 prints
    assert (report["layout"], report["world_size"], report["tp"], report["pp"]) == (
        "megatron_legacy",
        4,
        2,
        2,
    )
    _assert_bit_exact(load_safetensors(out / "model.safetensors"), model)


def test_python_m_demo(no_shm_leak: None) -> None:
    temp = Path(os.environ.get("TMPDIR", "/tmp"))
    before = set(temp.glob("du_demo_*"))
    proc = _cli("demo")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified bit-exact: " in proc.stdout
    assert "[1/2] mesh" in proc.stdout and "tp group [0, 1]: all_reduce sum 1, barrier ok" in proc.stdout
    assert "transport:  shm" in proc.stdout and "peak memory of rank 0" in proc.stdout
    assert set(temp.glob("du_demo_*")) <= before, "the demo left its temporary directory"


# --------------------------------------------------------------------------------------------------------
# A full disk (root: a private small tmpfs).


def _in_small_tmpfs(mount: Path, size: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    mount.mkdir()
    cli = " ".join([sys.executable, "-m", "distribute_utils", *argv])
    script = f"mount --make-rprivate / && mount -t tmpfs -o size={size} tmpfs {mount} && exec {cli}"
    return subprocess.run(
        ["unshare", "--mount", "--fork", "sh", "-c", script], capture_output=True, text=True, timeout=120
    )


@needs_root
def test_disk_full_names_the_path(model: dict[str, torch.Tensor], ckpt: Path, tmp_path: Path) -> None:
    total = sum(t.numel() * t.element_size() for t in model.values())
    # too small from the start: refused before anything moves
    proc = _in_small_tmpfs(
        tmp_path / "tiny",
        "64k",
        ["consolidate", str(ckpt), str(tmp_path / "tiny" / "out"), "--nproc", "1", "-q"],
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "[Errno 28] no space left for the consolidated checkpoint" in lines[0]
    assert f"'{tmp_path / 'tiny' / 'out'}'" in lines[0]
    # room for the tensor bytes but not for many small files' page slack: fails while writing
    size = f"{(total // 4096 + 2) * 4}k"
    out = tmp_path / "small" / "out"
    proc = _in_small_tmpfs(
        tmp_path / "small",
        size,
        ["consolidate", str(ckpt), str(out), "--nproc", "1", "-q", "--max-shard-size", "16KB"],
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and f"'{out}'" in lines[0], lines
    assert "cannot write tensor '" in lines[0]


def test_doctor_reports_and_fails_on_an_unusable_workspace(tmp_path, capsys) -> None:
    from distribute_utils.cli import main

    assert main(["doctor", "--workspace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "/dev/shm" in out and "torch" in out and str(tmp_path) in out
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["doctor", "--workspace", str(a_file)]) == 1
    assert "not a directory" in capsys.readouterr().out


def test_clean_removes_only_dead_owners_segments(tmp_path, capsys) -> None:
    import os
    import subprocess
    import sys

    from distribute_utils.cli import main

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = f"/dev/shm/du_{os.urandom(8).hex()}_1_{dead_pid}"
    live = f"/dev/shm/du_{os.urandom(8).hex()}_1_{os.getpid()}"
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
    try:
        assert main(["clean", "--dry-run", "--workspace", str(tmp_path)]) == 0
        assert os.path.exists(stale) and stale.rsplit("/", 1)[1] in capsys.readouterr().out
        assert main(["clean", "--workspace", str(tmp_path)]) == 0
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_doctor_and_clean_help_name_their_options(capsys) -> None:
    import pytest

    from distribute_utils.cli import main

    for command, options in (("doctor", ["--workspace"]), ("clean", ["--workspace", "--dry-run"])):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        text = capsys.readouterr().out
        assert all(option in text for option in options) and "Exit codes" in text


# --------------------------------------------------------------------------------------------------------
# Output folders: never mixed, never deleted unless asked; scripting.


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _others(d: Path) -> dict[str, bytes]:
    """Files of other names beside an output (a user's checkpoint among them), to check they survive."""
    d.mkdir(exist_ok=True)
    mine = {"llama.safetensors": b"someone's model", "NOTES.txt": b"mine", "model.bin": b"other scheme"}
    for name, data in mine.items():
        (d / name).write_bytes(data)
    return mine


def _assert_untouched(d: Path, mine: dict[str, bytes]) -> None:
    for name, data in mine.items():
        assert (d / name).read_bytes() == data, name


def _consolidate(capsys, *argv: str) -> tuple[int, str, str]:
    code = _exit_code(["consolidate", *argv, "-q"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_file_output_replaces_only_that_file(model, ckpt: Path, tmp_path: Path, capsys) -> None:
    """OUTPUT m/new.safetensors beside other checkpoints: only that file is ever written or replaced."""
    m = tmp_path / "m"
    mine = _others(m)
    new = m / "new.safetensors"
    assert _consolidate(capsys, str(ckpt), str(new))[0] == 0  # other files are no reason to refuse
    assert _names(m) == sorted([*mine, "new.safetensors"])
    new.write_bytes(b"an older new.safetensors")
    code, _, err = _consolidate(capsys, str(ckpt), str(new))
    assert code == 2 and "already has new.safetensors, which this run would replace" in err
    assert "--overwrite" in err and "not empty" not in err and "llama" not in err
    assert new.read_bytes() == b"an older new.safetensors"
    code, out, _ = _consolidate(capsys, str(ckpt), str(new), "--overwrite", "--json")
    assert code == 0 and json.loads(out)["replaced"] == [str(new)]
    assert _names(m) == sorted([*mine, "new.safetensors"])
    _assert_untouched(m, mine)
    _assert_bit_exact(load_safetensors(new), model)
    code, out, _ = _consolidate(capsys, str(ckpt), str(new), "--overwrite")
    assert code == 0 and f"replaced:   {new} (the older files of these names)" in out


def test_sharded_file_output_replaces_only_its_shards(ckpt: Path, tmp_path: Path, capsys) -> None:
    m = tmp_path / "m"
    mine = _others(m)
    out = m / "new.safetensors"
    assert _consolidate(capsys, str(ckpt), str(out), "--max-shard-size", "200KB")[0] == 0
    written = [n for n in _names(m) if n not in mine]
    assert len(written) > 2 and "new.safetensors.index.json" in written
    code, _, err = _consolidate(capsys, str(ckpt), str(out), "--max-shard-size", "200KB")
    assert code == 2 and ", ".join(written) in err  # exactly the files that would be replaced
    code, stdout, _ = _consolidate(
        capsys, str(ckpt), str(out), "--max-shard-size", "200KB", "--overwrite", "--json"
    )
    assert code == 0 and sorted(Path(f).name for f in json.loads(stdout)["replaced"]) == written
    assert _names(m) == sorted([*mine, *written])
    _assert_untouched(m, mine)


def test_directory_output_single_and_sharded(model, ckpt: Path, tmp_path: Path, capsys) -> None:
    """A directory OUTPUT: model.safetensors (or its shards + index) replaced with --overwrite, others kept;
    a previous run's files of another split are refused, named, never deleted."""
    out = tmp_path / "out"
    mine = _others(out)
    assert _consolidate(capsys, str(ckpt), str(out))[0] == 0
    assert _names(out) == sorted([*mine, "model.safetensors"])
    code, _, err = _consolidate(capsys, str(ckpt), str(out))
    assert code == 2 and "already has model.safetensors, which this run would replace" in err
    code, stdout, _ = _consolidate(capsys, str(ckpt), str(out), "--overwrite", "--json")
    assert code == 0 and json.loads(stdout)["replaced"] == [str(out / "model.safetensors")]
    # Another split (sharded) beside model.safetensors: refused even with --overwrite, naming it.
    code, _, err = _consolidate(capsys, str(ckpt), str(out), "--max-shard-size", "200KB", "--overwrite")
    assert code == 2 and "holds model.safetensors: files of the same naming scheme" in err
    assert "remove them yourself" in err
    assert _names(out) == sorted([*mine, "model.safetensors"])
    (out / "model.safetensors").unlink()  # the user removes it, as told
    assert _consolidate(capsys, str(ckpt), str(out), "--max-shard-size", "200KB")[0] == 0
    shards = [n for n in _names(out) if n not in mine]
    assert len(shards) > 2 and "model.safetensors.index.json" in shards
    code, stdout, _ = _consolidate(
        capsys, str(ckpt), str(out), "--max-shard-size", "200KB", "--overwrite", "--json"
    )
    assert code == 0 and sorted(Path(f).name for f in json.loads(stdout)["replaced"]) == shards
    # Back to one file: the shards and index of the previous run are named, and left in place.
    code, _, err = _consolidate(capsys, str(ckpt), str(out), "--overwrite")
    assert code == 2 and f"holds {', '.join(shards)}: files of the same naming scheme" in err
    assert _names(out) == sorted([*mine, *shards])
    _assert_untouched(out, mine)
    _assert_bit_exact(_load_dir_shards(out, shards), model)


def _load_dir_shards(out: Path, shards: list[str]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for name in shards:
        if name.endswith(".safetensors"):
            found.update(load_safetensors(out / name))
    return found


def test_torch_directory_output_refuses_a_stale_safetensors(ckpt: Path, tmp_path: Path, capsys) -> None:
    """Hugging Face loaders prefer model.safetensors over pytorch_model.bin: an old one is named, not kept
    silently beside a new torch output; a file OUTPUT of the other format's extension is a usage error."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    code, _, err = _consolidate(capsys, str(ckpt), str(out), "--format", "torch", "--overwrite")
    assert code == 2 and "holds model.safetensors" in err and "pytorch_model.bin" in err
    code, _, err = _consolidate(capsys, str(ckpt), str(out / "x.safetensors"), "--format", "torch")
    assert code == 2 and "ends in .safetensors, but the torch format writes .bin files" in err
    assert _names(out) == ["model.safetensors"]


def test_missing_output_parent_is_a_usage_error(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "typo" / "out"
    assert _exit_code(["consolidate", str(ckpt), str(out), "-q"]) == 2
    assert not (tmp_path / "typo").exists()


def test_a_failed_run_leaves_no_output_folder(ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "rank_00003.safetensors").write_bytes(b"\\x00" * 16)  # a corrupt shard
    out = tmp_path / "out"
    assert _exit_code(["consolidate", str(broken), str(out), "-q"]) == 1
    assert not out.exists()


def test_json_on_failure_prints_an_error_object(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("")
    proc = _cli("consolidate", str(ckpt), str(out), "--json")
    assert proc.returncode == 2
    error = json.loads(proc.stdout)
    assert (
        error["exit_code"] == 2
        and error["kind"] == "UsageError"
        and "already has model.safetensors" in error["error"]
    )
    proc = _cli("consolidate", str(tmp_path / "out"), str(tmp_path / "new"), "--json")
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"].startswith("input")


def test_dry_run_prints_the_plan_and_writes_nothing(model, ckpt: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert _exit_code(["consolidate", str(ckpt), str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in text and "concat:0" in text
    assert f"{len(model)} tensors" in text and "nothing written" in text
    assert not out.exists()
    assert _exit_code(["consolidate", str(ckpt), str(out), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["tensors"]) == len(model) and plan["bytes"] == sum(t.nbytes for t in model.values())
    assert not out.exists()


def test_demo_keep_never_deletes_user_files(tmp_path: Path, capsys) -> None:
    proj = tmp_path / "myproj"
    (proj / "checkpoint").mkdir(parents=True)
    (proj / "checkpoint" / "my_real_ckpt.pt").write_bytes(b"precious")
    (proj / "checkpoint" / "mesh.json").write_text("{}")  # the name of a file the demo writes
    assert _exit_code(["demo", "--keep", str(proj), "--size-mb", "1"]) == 2
    assert "already has mesh.json" in capsys.readouterr().err
    assert (proj / "checkpoint" / "my_real_ckpt.pt").read_bytes() == b"precious"
    assert sorted(p.name for p in proj.iterdir()) == ["checkpoint"]
    assert _exit_code(["demo", "--keep", str(proj), "--size-mb", "1", "--overwrite"]) == 0
    assert (proj / "checkpoint" / "my_real_ckpt.pt").read_bytes() == b"precious"
    assert _names(proj / "consolidated") == ["model.safetensors"]
