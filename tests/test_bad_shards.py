"""Unreadable input files through the real command: one line naming the file and what is wrong, exit 1.

Every input format the command reads (Megatron-LM legacy ``model_optim_rng.pt``, the own layout's
safetensors and ``torch.save`` files, DCP ``.distcp`` and ``.metadata``) is damaged in each way a user meets
(text, empty, cut in half, one byte left, bytes overwritten). Checkpoints are small and written with the
package's own writers; the command runs in this process (``main``) and, for the grid layouts, with
``--nproc 4`` as a subprocess (the ranks' path).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distribute_utils.cli import main
from distribute_utils.consolidate import write_own_layout
from distribute_utils.consolidate.megatron import write_megatron_legacy
from distribute_utils.consolidate.synthetic import make_gpt_state_dict, shard_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LPS = [2, 2]


def _text(p: Path) -> None:
    p.write_text("hello\n")


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _half(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _one_byte(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:1])


def _scribbled(p: Path) -> None:
    """Same size, the first stored item's zip header overwritten (a bad copy)."""
    data = bytearray(p.read_bytes())
    data[:64] = b"\xff" * 64
    p.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "text": (_text, "is not a"),
    "empty": (_empty, "is empty (0 bytes)"),
    "half": (_half, "truncated"),
    "one_byte": (_one_byte, "truncated"),
}


@pytest.fixture(scope="module")
def shards() -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    model = make_gpt_state_dict(num_layers=4, hidden=64, ffn_hidden=256, vocab=512, seed=3)
    return shard_state_dict(model, 2, 2, layers_per_stage=LPS)


def _megatron(root: Path, shards: dict) -> Path:
    write_megatron_legacy(root, shards, iteration=1200)
    return root / "iter_0001200" / "mp_rank_01_001" / "model_optim_rng.pt"


def _own(root: Path, shards: dict, file_format: str) -> Path:
    write_own_layout(root, shards, file_format=file_format, layers_per_stage=LPS)
    return next(p for p in sorted(root.iterdir()) if p.name.startswith("rank_00003"))


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line(code: int, out: str, err: str, bad: Path, says: str) -> None:
    lines = err.strip().splitlines()
    assert code == 1, err
    assert len(lines) == 1 and lines[0].startswith("distribute-utils consolidate: error"), err
    assert f"'{bad}'" in lines[0] and says in lines[0], lines[0]
    assert "weights_only" not in lines[0] and "Traceback" not in err
    error = json.loads(out)
    assert error["exit_code"] == 1 and f"'{bad}'" in error["error"] and says in error["error"]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("layout", ["megatron", "own_torch", "own_safetensors"])
def test_a_damaged_shard_is_one_line_naming_it(
    layout: str, damage: str, shards: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    bad = _megatron(root, shards) if layout == "megatron" else _own(root, shards, layout[4:])
    spoil, says = DAMAGE[damage]
    spoil(bad)
    out = tmp_path / "out"
    code, stdout, err = _run(["consolidate", str(root), str(out), "-q", "--json"], capsys)
    _assert_one_line(code, stdout, err, bad, says)
    assert not out.exists()


def test_a_pre_1_6_torch_file_cut_short_is_named(shards: dict, tmp_path: Path, capsys) -> None:
    root = tmp_path / "ckpt"
    bad = _megatron(root, shards)
    torch.save({"model": {"w": torch.ones(1000)}}, bad, _use_new_zipfile_serialization=False)
    _half(bad)
    code, stdout, err = _run(["consolidate", str(root), str(tmp_path / "out"), "-q", "--json"], capsys)
    _assert_one_line(code, stdout, err, bad, "is truncated or corrupt (a pre-1.6 torch.save file")


@pytest.mark.parametrize("damage", ["half", "text"])
def test_with_ranks_a_damaged_shard_is_one_line_naming_it(damage: str, shards: dict, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    bad = _megatron(root, shards)
    spoil, says = DAMAGE[damage]
    spoil(bad)
    argv = ["consolidate", str(root), str(tmp_path / "out"), "--nproc", "4", "-q", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "distribute_utils", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    _assert_one_line(proc.returncode, proc.stdout, proc.stderr, bad, says)
    assert not (tmp_path / "out").exists()


def _dcp(root: Path) -> None:
    dcp.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, checkpoint_id=str(root))


@pytest.mark.parametrize(
    ("damage", "says"),
    [("text", "truncated"), ("empty", "truncated"), ("half", "truncated"), ("scribbled", "is corrupt: item")],
)
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_damaged_distcp_file_is_one_line_naming_it(
    damage: str, says: str, fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    _dcp(root)
    (bad,) = root.glob("*.distcp")
    {**{k: v[0] for k, v in DAMAGE.items()}, "scribbled": _scribbled}[damage](bad)
    argv = ["consolidate", str(root), str(tmp_path / "out"), "-q", "--json", "--format", fmt]
    code, stdout, err = _run(argv, capsys)
    _assert_one_line(code, stdout, err, bad, says)


@pytest.mark.parametrize("damage", ["text", "empty", "half"])
def test_damaged_dcp_metadata_is_one_line_naming_it(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    _dcp(root)
    bad = root / ".metadata"
    spoil, _ = DAMAGE[damage]
    spoil(bad)
    says = {"text": "is not a DCP metadata file", "empty": "is empty", "half": "is truncated or corrupt"}[
        damage
    ]
    code, stdout, err = _run(["consolidate", str(root), str(tmp_path / "out"), "-q", "--json"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and str(bad) in lines[0] and says in lines[0], err
    assert json.loads(stdout)["exit_code"] == 1
