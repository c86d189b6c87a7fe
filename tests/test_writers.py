"""Streaming safetensors / torch.save writers and the safetensors reader."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distribute_utils.consolidate import (
    CheckpointFormatError,
    Concat,
    Max,
    SafetensorsWriter,
    TensorSpec,
    TorchSaveWriter,
    load_safetensors,
    open_writer,
    write_merged,
)
from distribute_utils.consolidate.writers import (
    DTYPE_TO_SAFETENSORS,
    parse_size,
    read_safetensors_metadata,
    read_safetensors_specs,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "w32": torch.randn(8, 8, generator=g),
        "f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(3, generator=g).to(torch.float8_e5m2),
        "mask": torch.randn(5, generator=g) > 0,
        "i8": torch.randint(-100, 100, (7,), generator=g, dtype=torch.int8),
        "i64": torch.arange(3, dtype=torch.int64),
        "f16": torch.randn(2, 3, generator=g).half(),
        "f64": torch.randn(2, generator=g).double(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }


def _write_all(writer, sd: dict[str, torch.Tensor], reverse: bool = True) -> list[Path]:
    names = list(sd)[::-1] if reverse else list(sd)
    with writer as w:
        for n in names:
            w.write(n, sd[n])
    return writer.paths


def _specs(sd: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in sd.items()]


def test_single_file_round_trip_against_safetensors(tmp_path: Path) -> None:
    sd = _state()
    paths = _write_all(SafetensorsWriter(tmp_path, _specs(sd)), sd)
    assert paths == [tmp_path / "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temp files left
    _assert_same(load_file(paths[0]), sd)
    _assert_same(load_safetensors(paths[0]), sd)
    _assert_same(load_safetensors(paths[0], mmap=False), sd)
    with safe_open(str(paths[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert read_safetensors_metadata(paths[0]) == {"format": "pt"}
    # File (offset) order: the writer lays data out by decreasing item size, stable within a size.
    in_file = sorted(sd, key=lambda n: -sd[n].element_size())
    assert [s.name for s in read_safetensors_specs(paths[0])] == in_file


def test_header_layout_is_aligned_and_hole_free(tmp_path: Path) -> None:
    sd = {"a": torch.ones(3, dtype=torch.uint8), "b": torch.ones(2, dtype=torch.float64), "c": torch.ones(1)}
    path = _write_all(SafetensorsWriter(tmp_path / "x.safetensors", _specs(sd), metadata={"k": "v"}), sd)[0]
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 : 8 + n]
    assert body.rstrip(b" ").endswith(b"}") and len(body) - len(body.rstrip(b" ")) < 8  # padded with spaces
    assert header["__metadata__"] == {"k": "v"}
    assert header["b"] == {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}
    assert header["c"]["data_offsets"] == [16, 20]
    assert header["a"]["data_offsets"] == [20, 23]
    assert len(raw) == 8 + n + 23


def test_compatible_with_files_written_by_safetensors(tmp_path: Path) -> None:
    sd = {k: v.contiguous() for k, v in _state().items() if k != "empty"}
    save_file(sd, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    _assert_same(load_safetensors(tmp_path / "ref.safetensors"), sd)
    assert {s.name: s.shape for s in read_safetensors_specs(tmp_path / "ref.safetensors")} == {
        k: tuple(v.shape) for k, v in sd.items()
    }


def test_sharded_output_and_index(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each
    sd["big"] = torch.zeros(50)  # 200 bytes, over the limit: gets its own shard
    sd["tail"] = torch.ones(2)
    writer = SafetensorsWriter(tmp_path, _specs(sd), max_shard_size=100)
    paths = _write_all(writer, sd)
    names = [p.name for p in paths]
    assert names == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)] + [
        "model.safetensors.index.json"
    ]
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 5 * 40 + 200 + 8}
    expected = {"t0": 0, "t1": 0, "t2": 1, "t3": 1, "t4": 2, "big": 3, "tail": 4}
    assert index["weight_map"] == {n: names[i] for n, i in sorted(expected.items())}
    loaded: dict[str, torch.Tensor] = {}
    for shard in paths[:-1]:
        part = load_file(shard)
        tensor_bytes = sum(t.numel() * t.element_size() for t in part.values())
        assert tensor_bytes <= 100 or list(part) == ["big"]
        for n in part:
            assert index["weight_map"][n] == shard.name
        loaded.update(part)
    _assert_same(loaded, sd)


def test_shard_size_limit_is_respected(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.randn(i + 1, 7) for i in range(12)}
    paths = _write_all(SafetensorsWriter(tmp_path, _specs(sd), max_shard_size="400B"), sd)
    index = json.loads(paths[-1].read_text())
    assert set(index["weight_map"]) == set(sd)
    for shard in paths[:-1]:
        part = load_file(shard)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 400 or len(part) == 1
    names = list(index["weight_map"].values())
    assert len(set(names)) == len(paths) - 1


def test_everything_fits_gives_single_file_without_index(tmp_path: Path) -> None:
    sd = {"a": torch.ones(4)}
    paths = _write_all(SafetensorsWriter(tmp_path, _specs(sd), max_shard_size="1GB"), sd)
    assert [p.name for p in paths] == ["model.safetensors"]


def test_missing_tensor_at_close_leaves_nothing(tmp_path: Path) -> None:
    sd = _state()
    out = tmp_path / "out"
    writer = SafetensorsWriter(out, _specs(sd), max_shard_size=64)
    writer.write("emb", sd["emb"])
    with pytest.raises(CheckpointFormatError, match=r"were never written: 'w32', 'f8'"):
        writer.close()
    assert not out.exists(), "nothing left, not even the directory the writer made"
    kept = tmp_path / "kept"  # a directory that was there before stays
    kept.mkdir()
    writer = SafetensorsWriter(kept, _specs(sd))
    writer.abort()
    assert kept.is_dir() and os.listdir(kept) == []


def test_exception_in_context_removes_temps(tmp_path: Path) -> None:
    sd = _state()
    with (
        pytest.raises(RuntimeError, match="boom"),
        TorchSaveWriter(tmp_path, _specs(sd), max_shard_size=64) as w,
    ):
        w.write("emb", sd["emb"])
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"), SafetensorsWriter(tmp_path, _specs(sd)) as w2:
        w2.write("emb", sd["emb"])
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_write_validation_names_the_tensor(tmp_path: Path) -> None:
    specs = [TensorSpec("a.weight", torch.float32, (2, 3))]
    with SafetensorsWriter(tmp_path, specs) as w:
        with pytest.raises(
            CheckpointFormatError, match=r"'a\.weight' does not match.*torch.bfloat16.*torch.float32"
        ):
            w.write("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16))
        with pytest.raises(CheckpointFormatError, match=r"'a\.weight' does not match.*\(3, 2\)"):
            w.write("a.weight", torch.zeros(3, 2))
        with pytest.raises(CheckpointFormatError, match="'nope' is not in"):
            w.write("nope", torch.zeros(1))
        w.write("a.weight", torch.zeros(2, 3))
        with pytest.raises(CheckpointFormatError, match=r"'a\.weight' was already written"):
            w.write("a.weight", torch.zeros(2, 3))
    assert (tmp_path / "model.safetensors").is_file()


def test_unsupported_dtype_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointFormatError, match=r"'c' has dtype torch.complex128.*supported: float64, float32"
    ):
        SafetensorsWriter(tmp_path, [TensorSpec("c", torch.complex128, (2,))])
    assert os.listdir(tmp_path) == []


def test_duplicate_specs_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'a' appears twice"):
        SafetensorsWriter(tmp_path, [TensorSpec("a", torch.float32, (1,))] * 2)


def test_dtype_table_covers_required_names() -> None:
    required = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL"}
    assert required <= set(DTYPE_TO_SAFETENSORS.values())
    assert {"C64", "U16", "U32", "U64"} <= set(DTYPE_TO_SAFETENSORS.values())


def test_unsigned_and_complex_round_trip(tmp_path: Path) -> None:
    sd = {
        "u16": torch.arange(4).to(torch.uint16),
        "u32": torch.arange(4).to(torch.uint32),
        "u64": torch.arange(4).to(torch.uint64),
        "c64": torch.randn(3, dtype=torch.complex64),
    }
    path = _write_all(SafetensorsWriter(tmp_path, _specs(sd)), sd)[0]
    _assert_same(load_safetensors(path), sd)
    _assert_same(load_file(path), sd)


def test_torch_writer_single_and_sharded(tmp_path: Path) -> None:
    sd = _state()
    base = torch.arange(100.0)
    sd["view"] = base[10:20]  # a view: only its own 10 floats may be saved
    paths = _write_all(TorchSaveWriter(tmp_path / "one", _specs(sd)), sd)
    assert [p.name for p in paths] == ["pytorch_model.bin"]
    loaded = torch.load(paths[0], weights_only=True)
    assert list(loaded) == list(sd)
    _assert_same(loaded, sd)
    assert loaded["view"].untyped_storage().nbytes() == 40

    paths = _write_all(TorchSaveWriter(tmp_path / "many", _specs(sd), max_shard_size=200), sd, reverse=False)
    assert paths[-1].name == "pytorch_model.bin.index.json"
    assert paths[0].name.startswith("pytorch_model-00001-of-")
    index = json.loads(paths[-1].read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    merged: dict[str, torch.Tensor] = {}
    for p in paths[:-1]:
        part = torch.load(p, weights_only=True)
        assert all(index["weight_map"][n] == p.name for n in part)
        merged.update(part)
    _assert_same(merged, sd)


def test_torch_writer_flushes_complete_shards_early(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.ones(25) for i in range(4)}  # 100 bytes each, one per shard
    w = TorchSaveWriter(tmp_path, _specs(sd), max_shard_size=100)
    w.write("t2", sd["t2"])
    # (its temporaries are named in the output folder)
    written = [p for p in tmp_path.iterdir() if p.stat().st_size]
    assert len(written) == 1, written
    assert list(torch.load(written[0], weights_only=True)) == ["t2"], "shard 2 saved to its temp file at once"
    assert w.held == 0, "and not held in memory any more"
    for n in ("t0", "t1", "t3"):
        w.write(n, sd[n])
    w.close()
    assert len(os.listdir(tmp_path)) == 5


def test_open_writer(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (1,))]
    assert isinstance(open_writer("safetensors", tmp_path / "s", specs), SafetensorsWriter)
    assert isinstance(open_writer("torch", tmp_path / "t", specs, "1MB"), TorchSaveWriter)
    with pytest.raises(ValueError, match="valid: safetensors, torch"):
        open_writer("gguf", tmp_path, specs)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1000000", 1_000_000),
        (12345, 12345),
        ("5GB", 5 * 10**9),
        ("500MiB", 500 * 2**20),
        ("500mb", 500 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("10 KB", 10_000),
        ("7B", 7),
    ],
)
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "GB", "5XB", "-1", "0", "1e9", "5 G B"])
def test_parse_size_errors(bad: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        parse_size(bad)


def test_reader_rejects_malformed_files(tmp_path: Path) -> None:
    """safetensors' own validation, each error naming the file (as CheckpointFormatError)."""
    p = tmp_path / "bad.safetensors"

    def header(h: dict | list, data: bytes) -> None:
        raw = json.dumps(h).encode()
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)

    cases = [
        (lambda: p.write_bytes(b"abc"), "header too small"),
        (lambda: p.write_bytes(struct.pack("<Q", 1000) + b"{}"), "invalid header length"),
        (lambda: header([], b""), "invalid JSON in header"),
        (lambda: header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "offset"),
        (lambda: header({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "X9"),
        (lambda: header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "offset"),
        (lambda: header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8)), "covered"),
        (lambda: header({"a": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "missing field `dtype`"),
    ]
    for write, says in cases:
        write()
        for read in (load_safetensors, read_safetensors_specs, read_safetensors_metadata):
            with pytest.raises(
                CheckpointFormatError, match=rf"'{p}' is not a valid safetensors file: .*{says}"
            ):
                read(p)
    # Valid for safetensors, but torch has no dtype for it: our message names tensor and dtype.
    header({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1))
    with pytest.raises(CheckpointFormatError, match="tensor 'a' has unsupported dtype 'F4'"):
        load_safetensors(p)
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path / "missing.safetensors")


def test_mmap_views_are_copy_on_write(tmp_path: Path) -> None:
    sd = {"a": torch.arange(8.0)}
    path = _write_all(SafetensorsWriter(tmp_path, _specs(sd)), sd)[0]
    t = load_safetensors(path)["a"]
    t += 1  # writable, but private: the file is unchanged
    _assert_same(load_file(path), sd)


@pytest.mark.parametrize("writer_cls", [SafetensorsWriter, TorchSaveWriter])
def test_write_merged_streams_concat_in_place(tmp_path: Path, writer_cls) -> None:
    g = torch.Generator().manual_seed(5)
    cases = {
        "rows": (Concat(0), [torch.randn(3, 8, generator=g) for _ in range(3)]),
        "cols_2k": (
            Concat(1),
            [torch.randn(4, 1024, generator=g).bfloat16() for _ in range(2)],
        ),  # 2 KiB slices
        "cols_4k": (
            Concat(-1),
            [torch.randn(2, 3, 1024, generator=g) for _ in range(2)],
        ),  # 4 KiB slices: pwritev
        "cols_small": (
            Concat(1),
            [torch.randn(5, 2, generator=g) for _ in range(2)],
        ),  # tiny slices: cat first
        "lead1": (Concat(1), [torch.randn(1, 3, 4, generator=g) for _ in range(2)]),
        "scale": (Max(), [torch.tensor(1.0), torch.tensor(3.0)]),
        "f8": (Concat(1), [torch.randn(2, 4096, generator=g).to(torch.float8_e4m3fn) for _ in range(2)]),
    }
    expected = {n: rule.merge(n, parts) for n, (rule, parts) in cases.items()}
    with writer_cls(tmp_path, _specs(expected)) as w:
        for n, (rule, parts) in cases.items():
            write_merged(w, n, rule, parts, ranks=list(range(len(parts))))
        with pytest.raises(ValueError, match=r"'rows'.*already written"):
            write_merged(w, "rows", Concat(0), cases["rows"][1])
        with pytest.raises(ValueError, match=r"'x'.*rank 0: \(2, 3\), rank 1: \(2, 4\)"):
            write_merged(w, "x", Concat(0), [torch.zeros(2, 3), torch.zeros(2, 4)], ranks=[0, 1])
    path = w.paths[0]
    loaded = load_file(path) if writer_cls is SafetensorsWriter else torch.load(path, weights_only=True)
    _assert_same(loaded, expected)


@pytest.mark.parametrize("finish", ["close", "abort"])
def test_temporaries_are_recorded_until_published_or_removed(tmp_path: Path, finish: str) -> None:
    """The writer records its temporaries (for ``clean`` after a kill -9) before they exist, and drops
    the record, and the record directory once empty, when it publishes or aborts."""
    from distribute_utils.temporaries import RECORD_DIR

    def records() -> set[str] | None:  # (records only: sockets of other processes come and go there)
        if not os.path.isdir(RECORD_DIR):
            return None
        return {n for n in os.listdir(RECORD_DIR) if n.endswith(".json")} or None

    before = records()
    sd = {"w": torch.arange(6.0)}
    w = SafetensorsWriter(tmp_path, _specs(sd))
    mine = (records() or set()) - (before or set())
    assert len(mine) == 1, mine
    listed = json.loads(Path(RECORD_DIR, mine.pop()).read_text())["paths"]
    assert len(listed) == 1 and Path(listed[0]).parent == tmp_path and os.path.exists(listed[0]), listed
    assert os.listdir(tmp_path) == [Path(listed[0]).name], "the record names the writer's one temporary"
    w.write("w", sd["w"])
    w.close() if finish == "close" else w.abort()
    assert records() == before, "the record (or its empty directory) was left"
    assert not os.path.exists(listed[0]), "the recorded temporary was published or removed"
    assert sorted(os.listdir(tmp_path)) == (["model.safetensors"] if finish == "close" else [])
