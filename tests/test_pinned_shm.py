"""CUDA tensors through shared memory (issue 35): a sender copies device to host straight into its
segment, registered with the CUDA runtime once; a first rank that wants them on a GPU registers its
map once and copies from it. Four gloo ranks share the GPUs there are (one on the test machine).

On a machine without CUDA these tests are skipped; ``test_wire.py`` and ``test_devices.py`` cover
the CPU side of the same paths (payloads with device entries, placement rules).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]

RANKS = [0, 1, 2, 3]


def _value(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s config: 2 MiB or more (so it goes through a pooled segment), several dtypes, a
    strided view made on ``device``, an empty tensor and a scalar; the same bytes wherever it is built."""
    base = torch.randn(512, 1024, generator=torch.Generator().manual_seed(rank))
    value = {
        "bf16": base.to(torch.bfloat16),
        "int8": (base * 20).to(torch.int8),
        "fp32": base,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(1.5 + rank),
    }
    if hasattr(torch, "float8_e4m3fn"):
        value["fp8"] = base.to(torch.float8_e4m3fn)
    value = {k: v.to(device) for k, v in value.items()}
    value["strided"] = value["fp32"][:, ::2]
    return value


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _rounds() -> dict[str, Any]:
    from distribute_utils import get_configs_parallel, get_tensors_parallel, release_shared_memory
    from distribute_utils.transports.pinning import registered_bytes

    rank = dist.get_rank()
    gpu = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    mine = _value(rank, gpu)
    expected = {r: _value(r, torch.device("cpu")) for r in RANKS}
    senders_gpus = [str(torch.device("cuda", r % torch.cuda.device_count())) for r in RANKS]
    problems: list[str] = []

    def check(what: str, got: list[Any], where: list[str]) -> None:
        for r, value in enumerate(got):
            pairs = value.items() if isinstance(value, dict) else [("bf16", value)]
            for key, t in pairs:
                if not _same(t, expected[r][key]):
                    problems.append(f"{what}: rank {r}'s {key} differs")
                if str(t.device) != where[r]:
                    problems.append(f"{what}: rank {r}'s {key} is on {t.device}, not {where[r]}")

    before = registered_bytes()
    for i in range(3):  # the first round goes through named segments; then pooled, registered ones
        with get_configs_parallel(mine, RANKS, transport="shm", device=gpu) as got:
            if got:
                check(f"round {i}, device={gpu}", got, [str(gpu)] * 4)
        with get_configs_parallel(mine, RANKS, transport="shm") as got:
            if got:
                check(f"round {i}, configs as sent", got, senders_gpus)
        with get_tensors_parallel(mine["bf16"], RANKS, transport="shm") as got:
            if got:
                check(f"round {i}, tensors", got, ["cpu"] * 4)
    del got  # (views of the first rank's maps: the segments stay busy while they live)
    torch.cuda.synchronize()
    held = registered_bytes()
    dist.barrier()
    release_shared_memory()
    dist.barrier()  # every first rank's maps are gone: the senders' segments are free
    release_shared_memory()
    after = registered_bytes()
    return {"problems": problems, "before": before, "held": held, "after": after}


def test_cuda_tensors_go_through_registered_shared_memory_bit_for_bit(ranks4: RankPool) -> None:
    results = ranks4.run(_rounds, timeout=240)
    for rank, result in enumerate(results):
        assert result["problems"] == [], (rank, result["problems"][:5])
    # The senders registered their pooled segments, the first rank its maps of them (kept whatever their
    # size); release_shared_memory gave every registration back.
    grown = [(r["held"][0] - r["before"][0], r["held"][1] - r["before"][1]) for r in results]
    for rank in (1, 2, 3):
        assert grown[rank][0] >= 1 and grown[rank][1] >= 2 * 2**20, (rank, grown)
    assert grown[0][0] >= 3 and grown[0][1] >= 3 * 2 * 2**20, ("the first rank's kept maps", grown)
    assert [r["after"] for r in results] == [r["before"] for r in results], results


def _refused_twice() -> dict[str, Any]:
    import mmap

    from distribute_utils.transports.pinning import Registration, registered_bytes

    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.cuda.init()
    mapped = mmap.mmap(-1, 4 * 2**20)
    first = Registration.of(mapped, len(mapped))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("distribute_utils.transports.pinning")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        second = Registration.of(mapped, len(mapped))  # already registered: the runtime refuses
    finally:
        log.removeHandler(handler)
    # A copy into the (registered) map works either way.
    view = torch.frombuffer(mapped, dtype=torch.uint8)
    src = torch.arange(view.numel(), device="cuda").to(torch.uint8)
    view.copy_(src)
    copied = bool(torch.equal(view, src.cpu()))
    held = registered_bytes()
    if first is not None:
        first.close()
    del view
    released = registered_bytes()
    return {
        "first": first is not None,
        "second": second is not None,
        "records": records,
        "copied": copied,
        "held": held,
        "released": released,
    }


def test_a_refused_registration_falls_back_with_a_debug_log(ranks4: RankPool) -> None:
    for result in ranks4.run(_refused_twice):
        assert result["first"] and not result["second"], result
        assert any("cuMemHostRegister" in r for r in result["records"]), result["records"]
        assert result["copied"]
        held, released = result["held"], result["released"]
        assert (held[0] - released[0], held[1] - released[1]) == (1, 4 * 2**20), result
