"""Reading torch.save files without running pickled code: stand-ins for Megatron's classes, refusals."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path

import pytest
import torch

from distribute_utils.consolidate import LayoutError, UnsafeCheckpointError, open_checkpoint, safe_torch_load
from distribute_utils.consolidate.safe_load import StandIn

_RAN: list[str] = []


def _fake_module(name: str) -> types.ModuleType:
    """A module that exists only while saving, so loading cannot import it."""
    module = types.ModuleType(name)

    class Mode(enum.Enum):
        A = 1
        B = 2

    class Config:
        def __setstate__(self, state):  # would run on a real unpickle
            _RAN.append("setstate")
            self.__dict__.update(state)

    for cls in (Mode, Config):
        cls.__module__ = name
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    return module


def _save_with(tmp_path: Path, name: str, build) -> Path:
    parts = name.split(".")
    added = [p for p in (".".join(parts[: i + 1]) for i in range(len(parts) - 1)) if p not in sys.modules]
    for parent in added:
        sys.modules[parent] = types.ModuleType(parent)
    module = _fake_module(name)
    sys.modules[name] = module
    try:
        path = tmp_path / "f.pt"
        torch.save(build(module), path)
    finally:
        for gone in [name, *added]:
            del sys.modules[gone]
    return path


def test_megatron_classes_load_as_inert_stand_ins(tmp_path: Path) -> None:
    def build(m):
        cfg = m.Config()
        cfg.__dict__.update(lr=3e-4, name="adam")
        return {"args": {"mode": m.Mode.B, "cfg": cfg}, "model": {"w": torch.ones(2)}}

    path = _save_with(tmp_path, "megatron.core.fake_enums", build)
    obj = safe_torch_load(path)
    mode, cfg = obj["args"]["mode"], obj["args"]["cfg"]
    assert isinstance(mode, StandIn) and mode.qualname == "megatron.core.fake_enums.Mode" and mode.value == 2
    assert isinstance(cfg, StandIn) and cfg.lr == 3e-4 and cfg.name == "adam"
    assert _RAN == [] and "megatron.core.fake_enums" not in sys.modules
    assert torch.equal(obj["model"]["w"], torch.ones(2))


def test_other_classes_are_refused_by_name(tmp_path: Path) -> None:
    path = _save_with(tmp_path, "someones.module", lambda m: {"x": m.Mode.A})
    with pytest.raises(UnsafeCheckpointError, match=r"someones\.module\.Mode.*never unpickles"):
        safe_torch_load(path)


def test_a_stand_in_inside_the_model_is_refused(tmp_path: Path) -> None:
    """A weight in a custom class would silently vanish: refused instead."""
    (tmp_path / "mp_rank_00").mkdir()
    path = _save_with(
        tmp_path, "transformer_engine.fake", lambda m: {"model": {"w": torch.ones(2), "q": m.Config()}}
    )
    path.rename(tmp_path / "mp_rank_00" / "model_optim_rng.pt")
    layout = open_checkpoint(tmp_path)
    with pytest.raises(LayoutError, match=r"'model' holds objects of classes that were not loaded \(q\)"):
        layout.load_shard(0, 0)
