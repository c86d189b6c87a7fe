"""Shards of different saves: refused before any tensor is read, naming both files and what each says;
a replicated tensor that differs names its files and suggests no rule that would hide the damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from distribute_utils.cli import main
from distribute_utils.consolidate import LayoutError, MergeError, consolidate_checkpoint
from distribute_utils.consolidate.megatron import MEGATRON_FILE, write_megatron_legacy

NORM = "decoder.layers.0.input_layernorm.weight"


def _shards(seed: int, norm_by_rank: bool = False) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        (t, p): {
            NORM: torch.ones(8) + seed + (t if norm_by_rank else 0),
            "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(6, 8, generator=g),
        }
        for t in range(2)
        for p in range(2)
    }


def _saves(tmp_path: Path) -> tuple[Path, Path]:
    """Iterations 1 and 2 of a TP2 x PP2 run; the second TP rank of stage 1 of iteration 2 copied over
    iteration 1's (what a hand-assembled checkpoint directory ends up with)."""
    write_megatron_legacy(tmp_path / "run", _shards(1), iteration=1)
    write_megatron_legacy(tmp_path / "later", _shards(2), iteration=2)
    stray = tmp_path / "later" / "iter_0000002" / "mp_rank_01_001" / MEGATRON_FILE
    mixed = tmp_path / "run" / "iter_0000001" / "mp_rank_01_001" / MEGATRON_FILE
    shutil.copy(stray, mixed)
    return tmp_path / "run", mixed


def test_a_shard_of_another_iteration_is_refused_naming_both_files(tmp_path: Path) -> None:
    ckpt, mixed = _saves(tmp_path)
    first = ckpt / "iter_0000001" / "mp_rank_00_000" / MEGATRON_FILE
    with pytest.raises(LayoutError) as info:
        consolidate_checkpoint(ckpt, tmp_path / "out")
    text = str(info.value)
    assert f"'{mixed}' says iteration 2; '{first}' says iteration 1" in text, text
    assert not (tmp_path / "out").exists(), "refused before anything was written"
    # The advice of old ("give it a rule") followed: still refused, not a silently wrong model.
    rules = tmp_path / "rules.txt"
    rules.write_text("*_layernorm.weight first\n")
    with pytest.raises(LayoutError, match="says iteration 2"):
        consolidate_checkpoint(ckpt, tmp_path / "out", rules=rules)


def test_the_first_shard_copied_from_another_save_is_named_by_its_directory(tmp_path: Path) -> None:
    write_megatron_legacy(tmp_path / "run", _shards(1), iteration=1)
    write_megatron_legacy(tmp_path / "later", _shards(2), iteration=2)
    first = tmp_path / "run" / "iter_0000001" / "mp_rank_00_000" / MEGATRON_FILE
    for t, p in ((0, 0), (1, 0), (0, 1), (1, 1)):
        shutil.copy(
            tmp_path / "later" / "iter_0000002" / f"mp_rank_{t:02d}_{p:03d}" / MEGATRON_FILE,
            tmp_path / "run" / "iter_0000001" / f"mp_rank_{t:02d}_{p:03d}" / MEGATRON_FILE,
        )
    with pytest.raises(LayoutError) as info:
        consolidate_checkpoint(tmp_path / "run", tmp_path / "out")
    assert f"'{first}' says iteration 2, but its directory is iter_0000001" in str(info.value)


def test_a_shard_of_another_run_layout_is_refused_naming_what_differs(tmp_path: Path) -> None:
    """Same iteration, another run's args (a gated MLP here): refused, both values named."""
    write_megatron_legacy(tmp_path / "run", _shards(1), iteration=1)
    write_megatron_legacy(tmp_path / "other", _shards(1), iteration=1, swiglu=True)
    name = Path("iter_0000001") / "mp_rank_00_001" / MEGATRON_FILE
    shutil.copy(tmp_path / "other" / name, tmp_path / "run" / name)
    with pytest.raises(LayoutError) as info:
        consolidate_checkpoint(tmp_path / "run", tmp_path / "out")
    assert f"'{tmp_path / 'run' / name}' says swiglu True;" in str(info.value)
    assert "says swiglu False" in str(info.value)


def test_a_replicated_tensor_that_differs_names_the_files_and_suggests_no_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_megatron_legacy(tmp_path / "run", _shards(1, norm_by_rank=True), iteration=1)
    with pytest.raises(MergeError) as info:
        consolidate_checkpoint(tmp_path / "run", tmp_path / "out")
    text = str(info.value)
    assert f"tensor '{NORM}' is replicated" in text and "rank 1 differs from rank 0" in text, text
    assert "give it a rule" not in text and "different saves or a file is damaged" in text
    for t in (0, 1):
        assert f"'{tmp_path / 'run' / 'iter_0000001' / f'mp_rank_{t:02d}_000' / MEGATRON_FILE}'" in text
    # With ranks: the same cause, its files named, one line.
    code = main(["consolidate", str(tmp_path / "run"), str(tmp_path / "out2"), "--nproc", "4"])
    err = capsys.readouterr().err
    assert code == 1 and "is replicated" in err and "mp_rank_01_00" in err, err  # (either stage)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_a_users_same_rule_that_fails_keeps_the_advice_and_names_the_files(tmp_path: Path) -> None:
    """Where the user (not the format) said 'same', a split or reduction is plausible: the advice stays."""
    shards = _shards(1)
    for t in range(2):
        shards[(t, 0)]["decoder.layers.0.custom.scale"] = torch.full((4,), float(t))
        shards[(t, 1)]["decoder.layers.0.custom.scale"] = torch.zeros(4)
    write_megatron_legacy(tmp_path / "run", shards, iteration=1)
    rules = tmp_path / "rules.txt"
    rules.write_text("*.custom.scale same\n")
    with pytest.raises(MergeError) as info:
        consolidate_checkpoint(tmp_path / "run", tmp_path / "out", rules=rules)
    text = str(info.value)
    assert "should be identical on every shard (rule 'same')" in text and "give it a rule" in text
    assert "mp_rank_01_000" in text, text


def test_a_shard_without_args_among_shards_with_them_is_refused(tmp_path: Path) -> None:
    """Either way round: a file another tool wrote (no ``args``) among Megatron's own is named."""
    write_megatron_legacy(tmp_path / "run", _shards(1), iteration=1)
    write_megatron_legacy(tmp_path / "bare", _shards(1), iteration=1, swiglu=None)  # (no args)
    for t, p in ((1, 1), (0, 0)):  # a later file without args; then the first one too
        name = Path("iter_0000001") / f"mp_rank_{t:02d}_{p:03d}" / MEGATRON_FILE
        shutil.copy(tmp_path / "bare" / name, tmp_path / "run" / name)
        with pytest.raises(LayoutError, match=r"the shards are not of one save: .* args\.tp"):
            consolidate_checkpoint(tmp_path / "run", tmp_path / "out")
