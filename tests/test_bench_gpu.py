"""``scripts/bench_gpu.py`` where there is no GPU: its refusal, its options, its pure helpers, and a dry
run of the whole machinery on the CPU (``--device cpu``: every method but the IPC floor, every byte read
and checked). What needs CUDA (registration, IPC, the copy limits, the figures) runs on a GPU machine
only: ``scripts/gpu_check.sh``, ``docs/gpu.md``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import SCRIPTS, load_script

# Importing ModelOpt (the dry run) imports megatron-core and torch.jit, which warn about themselves.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_says_so_in_one_line_and_exits_2() -> None:
    done = _bench("--sizes", "1M", timeout=120)
    assert done.returncode == 2, done
    assert done.stdout == "", done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert (
        lines[0].startswith("bench_gpu.py: CUDA is not available here (torch ") and "--device cpu" in lines[0]
    )


def test_help_runs_without_cuda_and_lists_the_options() -> None:
    done = _bench("--help", timeout=120)
    assert done.returncode == 0, done.stderr
    for option in ("--sizes", "--reps", "--nproc", "--json", "--device", "--layer-hidden"):
        assert option in done.stdout, option
    assert "256M" in done.stdout and "layer" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "1"], "--nproc must be at least 2"),
        (["--reps", "0"], "--reps must be at least 1"),
        (["--layer-hidden", "100"], "--layer-hidden must be a positive multiple of 32; got 100"),
        (["--device", "tpu"], "--device must be cuda, cuda:N or cpu; got 'tpu'"),
        (["--device", "meta"], "--device must be cuda, cuda:N or cpu; got 'meta'"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        load_script("bench_gpu").main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_checksum_reads_every_byte_adds_up_by_parts_and_sees_the_order() -> None:
    bench = load_script("bench_gpu")
    for nbytes in (4096, 4100, 7):  # a single 1 at any byte of the tensor: never the sum of zeros (0)
        single_ones = torch.eye(nbytes, dtype=torch.uint8)
        assert bench.checksum([torch.zeros(nbytes, dtype=torch.uint8)]) == 0
        assert all(bench.checksum([row]) != 0 for row in single_ones), nbytes
    parts = [
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.randn((), dtype=torch.float32),
        torch.full((1000,), -1, dtype=torch.int64),  # int64 sums that wrap
        torch.randn(8, 8)[:, 1:],  # not contiguous
    ]
    whole = bench.checksum(parts)
    assert whole == sum(bench.checksum([p], i) for i, p in enumerate(parts)) % bench.MOD
    assert whole == (bench.checksum(parts[:2]) + bench.checksum(parts[2:], 2)) % bench.MOD  # two ranks' parts
    assert whole != bench.checksum(parts[::-1])  # tensors in another order, or from another rank
    assert whole != bench.checksum(parts[1:] + parts[:1])
    assert 0 <= whole < bench.MOD


def test_pieces_of_an_aligned_buffer_sum_like_their_tensors() -> None:
    """A floor's receiver reads each tensor as a slice of one buffer laid out by ``layout``."""
    bench = load_script("bench_gpu")
    tensors = [torch.randn(5, dtype=torch.bfloat16), torch.randn(()), torch.randn(3, 8), torch.ones(3, 1)]
    offsets, size = bench.layout(tensors)
    assert offsets[0] == 0 and all(o % bench.ALIGN == 0 for o in offsets) and size % bench.ALIGN == 0
    buffer = torch.zeros(size, dtype=torch.uint8)
    pieces = [buffer[o : o + t.numel() * t.element_size()] for o, t in zip(offsets, tensors)]
    for piece, t in zip(pieces, tensors):
        piece.copy_(bench.as_bytes(t))
    assert bench.checksum(pieces) == bench.checksum(tensors)
    assert bench.layout([]) == ([], bench.ALIGN)


def test_rates_and_ratios() -> None:
    bench = load_script("bench_gpu")
    assert bench.gib_per_s(256 << 20, 5.0) == pytest.approx(50.0)
    medians = {"ours_shm": 390.0, "shm_floor": 29.0, "ours_cuda": 5.0, "modelopt": 2130.0, "gather": 0.0}
    got = bench.ratios(medians, bench.RATIOS)
    assert got == {
        "ours_shm/shm_floor": 390.0 / 29.0,
        "ours_shm/ours_cuda": 390.0 / 5.0,
        "modelopt/ours_cuda": 2130.0 / 5.0,
        "gather/ours_cuda": 0.0,
    }


@pytest.mark.slow
def test_the_layer_config_holds_the_same_tensors_as_dicts_and_as_modelopt_configs() -> None:
    bench = load_script("bench_gpu")
    plain = bench.layer_config(4096, 1, "cpu")
    tensors = bench.tensors_of(plain)
    assert len(tensors) == 30
    assert sum(t.numel() * t.element_size() for t in tensors) == pytest.approx(104 * 2**20, rel=0.01)
    assert bench.tensors_of(bench.layer_config(4096, 2, "cpu"))[0].ne(tensors[0]).any(), "seeded per rank"
    pytest.importorskip("modelopt.torch.export")
    theirs = bench.layer_config(256, 1, "cpu", bench.modelopt_node)
    assert type(theirs).__name__ == "DecoderLayerConfig"
    assert bench.checksum(bench.tensors_of(theirs)) == bench.checksum(
        bench.tensors_of(bench.layer_config(256, 1, "cpu"))
    )


def test_a_dry_run_on_the_cpu_runs_every_method_and_reads_every_byte(tmp_path: Path) -> None:
    """Every method but the IPC floor, on two ranks: each round's checksum is checked on rank 0 (a wrong
    one fails the case); the printed ratios are those of the figures; nothing stays in /dev/shm."""
    out = tmp_path / "r.json"
    args = ["--device", "cpu", "--nproc", "2", "--sizes", "1M", "layer", "--layer-hidden", "256"]
    done = _bench(*args, "--reps", "1", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["errors"] == {} and set(report["cases"]) == {"1M", "layer"}, report["errors"]
    methods = {"ours_cuda", "ours_shm", "ours_then_cuda", "collective", "gather", "shm_floor"}
    try:
        import modelopt.torch.export.distribute  # noqa: F401
    except ImportError:
        pass
    else:
        methods.add("modelopt")
    for name, case in report["cases"].items():
        assert set(case["summary"]) == methods, (name, case["summary"].keys())
        for method, figures in case["summary"].items():
            low, median, high = figures["all done"]
            assert 0 < low <= median <= high and figures["rank 0"][1] <= high, (name, method)
        medians = {m: v["all done"][1] for m, v in case["summary"].items()}
        for pair, value in case["ratios"].items():
            a, b = pair.split("/")
            assert value == pytest.approx(medians[a] / medians[b]), pair
        assert f"  {name}: ours_shm/shm_floor {case['ratios']['ours_shm/shm_floor']:.2f}" in done.stdout
    assert report["cases"]["1M"]["received_bytes"] == 1 << 20
    assert report["cases"]["layer"]["tensors"] == 30
    assert "on CPU (dry run):" in done.stdout
    assert not glob.glob("/dev/shm/du-bench-gpu-*"), "segments left behind"


def _gpu_check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``scripts/gpu_check.sh`` here, with its output folder in ``tmp_path``; no editable install (it would
    change this machine's environment) and one gpu-marked test as pytest's target."""
    out = tmp_path / "out"
    settings = {
        "OUT": str(out),
        "PYTHON": sys.executable,
        "WHEELS": str(tmp_path / "no-wheels"),
        "GPU_CHECK_SKIP": "editable",
        "GPU_CHECK_TESTS": "tests/test_wire.py::test_cuda_tensors",
        **env,
    }
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **settings},
    )
    return done, out


@pytest.mark.slow  # (the budget test below runs gpu_check.sh in the default suite)
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_gpu_check_runs_every_step_past_failures_and_sums_them_up(tmp_path: Path) -> None:
    """Without a GPU: nvidia-smi is missing and the bench refuses (exit 2), a carried wheel is broken, yet
    every later step runs; the last line names each step's exit status, and the log is in $OUT."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-0.1-py3-none-any.whl").write_bytes(b"not a zip")
    done, out = _gpu_check(tmp_path, WHEELS=str(wheels))
    assert done.returncode == 1, done.stdout[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    steps = dict(s.split("=", 1) for s in last.removeprefix("gpu_check: ").split(" -> ")[0].split())
    assert last.endswith("-> SOME FAILED"), last
    assert steps["versions"] == "0" and steps["imports"] == "0" and steps["gpu-tests"] == "0", last
    assert steps["editable"] == "skipped" and steps["bench"] == "2" and steps["export"] == "2", last
    assert steps["wheels"] != "0" and steps["machine"] != "0", last
    assert "1 skipped" in done.stdout and "CUDA is not available here" in done.stdout
    assert (out / "gpu_check.log").read_text() == done.stdout
    assert (out / "pytest-gpu.xml").exists()


def test_gpu_check_stays_within_its_budget(tmp_path: Path) -> None:
    done, _ = _gpu_check(tmp_path, GPU_CHECK_BUDGET_S="0")
    assert done.returncode == 1
    last = done.stdout.strip().splitlines()[-1]
    assert last == (
        "gpu_check: machine=no-time versions=no-time wheels=none editable=skipped imports=no-time "
        "gpu-tests=no-time bench=no-time export=no-time -> SOME FAILED"
    ), done.stdout
