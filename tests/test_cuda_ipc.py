"""The CUDA IPC route (``distribute_utils.transports.cuda_ipc``): CUDA tensors of ranks on one host
copied device to device into the first rank's GPU.

On the CPU: which payloads it takes (``can_carry``), its refusal of others, and its checks of a
receipt before anything is opened. gpu-marked (4 gloo ranks, sharing one GPU when there is one):
configs and tensors of several dtypes gathered exactly through it (seen in ``cuda_ipc.stats()``),
still exact after the senders freed and overwrote their originals; memory back to its baseline on
every rank and flat over many rounds; a sender killed after publishing and a first rank killed
while fetching, with nothing held or left open afterwards.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distribute_utils import wire
from distribute_utils.errors import PayloadError, TransportUnavailableError
from distribute_utils.transports import cuda_ipc
from distribute_utils.transports.cuda_ipc import CudaIpcTransport

from harness import Died, RankPool

RANKS = [0, 1, 2, 3]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)


# --------------------------------------------------------------------------- on the CPU
def test_can_carry_only_payloads_all_on_one_cuda_device() -> None:
    cpu = wire.encode({"w": torch.ones(40_000)}, keep_device=True)
    meta = wire.encode({"w": torch.empty(40_000, device="meta")}, keep_device=True)
    empty = wire.encode({"w": torch.empty(0)}, keep_device=True)
    plain = wire.encode({"n": 3}, keep_device=True)
    mixed = wire.EncodedPayload(
        256, b"\0" * 64, ((64, torch.ones(16)), (128, torch.empty(16, device="meta")))
    )
    for name, payload in {"cpu": cpu, "meta": meta, "empty": empty, "plain": plain, "mixed": mixed}.items():
        assert not CudaIpcTransport.can_carry(payload), name
    assert not meta.chunks and not empty.chunks  # (no bytes travel: nothing to open)


def test_publish_refuses_a_payload_it_cannot_carry() -> None:
    payload = wire.encode({"w": torch.ones(40_000)}, keep_device=True)
    with pytest.raises(TransportUnavailableError, match=r"rank 2's are on \['cpu'\]"):
        CudaIpcTransport().publish("t", 2, payload)
    assert cuda_ipc.stats()["held"] == 0


def _receipt(**change: Any) -> list[Any]:
    fields = {"head": b"h" * 64, "nbytes": 64 + 4096, "device": 0, "pid": os.getpid()}
    fields.update({k: v for k, v in change.items() if k != "chunks"})
    chunks = change.get("chunks", [[64, 4096, b"\1" * 64, 512, 1 << 20]])
    return ["cuda_ipc", fields["head"], fields["nbytes"], fields["device"], fields["pid"], chunks]


@pytest.mark.parametrize(
    ("receipt", "why"),
    [
        (["shm", "x"], "expected"),
        (_receipt()[:5], "expected"),
        (_receipt(head="text"), "head must be bytes"),
        (_receipt(nbytes=10), "head must be bytes"),
        (_receipt(device=-1), "device and pid"),
        (_receipt(chunks=[]), "non-empty list"),
        (_receipt(chunks=[[64, 4096, b"\1" * 63, 0, 1 << 20]]), "must be 64 bytes"),
        (_receipt(chunks=[[64, 4096, b"\1" * 64, 0]]), "each chunk is"),
        (_receipt(chunks=[[64, 8192, b"\1" * 64, 0, 1 << 20]]), "lies outside"),
        (_receipt(chunks=[[0, 4096, b"\1" * 64, 0, 1 << 20]]), "lies outside"),
        (_receipt(chunks=[[64, 4096, b"\1" * 64, 1 << 20, 1 << 20]]), "lies outside"),
        (_receipt(chunks=[[64, 0, b"\1" * 64, 0, 1 << 20]]), "lies outside"),
        (_receipt(nbytes=1 << 40), "more than its head and chunks"),
    ],
    ids=[
        "other-kind",
        "short",
        "head",
        "nbytes",
        "device",
        "no-chunks",
        "handle",
        "chunk-fields",
        "past-payload",
        "over-head",
        "past-allocation",
        "empty-chunk",
        "huge",
    ],
)
def test_fetch_refuses_a_malformed_receipt_before_opening_anything(receipt: list[Any], why: str) -> None:
    with pytest.raises(PayloadError, match="rank 3 published a malformed CUDA IPC receipt") as caught:
        CudaIpcTransport().fetch("t", 3, receipt)
    assert why in str(caught.value)
    assert cuda_ipc.stats()["open"] == 0


def test_receipts_are_told_apart_from_other_transports() -> None:
    assert cuda_ipc.is_receipt(_receipt())
    for other in (["inline", b"x"], ["shm", ["a", 1]], "cpu", None, ["attached", 10]):
        assert not cuda_ipc.is_receipt(other)
    CudaIpcTransport().discard("t", 1, _receipt())  # nothing was opened: nothing to do
    CudaIpcTransport().release("never-published", 1, taken=False)  # idempotent, nothing held


# --------------------------------------------------------------------------- on a GPU
def _gpu() -> torch.device:
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())


def _values(rank: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s config: ~1.2 MiB of several dtypes (above every inline size), an empty tensor and
    a non-contiguous view."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = {
        "bf16": torch.randn(256, 1024, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(64 * 1024, generator=g),
        "int8": torch.randint(-128, 128, (100_003,), generator=g, dtype=torch.int8),
        "empty": torch.empty(0, 7),
        "strided": torch.randn(128, 256, generator=g)[:, ::2],
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["fp8"] = torch.randn(64 * 1024, generator=g).to(torch.float8_e4m3fn)
    return {k: v.to(device) for k, v in out.items()}


def _wrong(got: dict[str, torch.Tensor], rank: int, device: str) -> list[str]:
    """How ``got`` differs from rank ``rank``'s values (those it has) on ``device``, bit for bit; empty
    when exact."""
    out = []
    for name, want in _values(rank, "cpu").items():
        if name not in got:
            continue
        t = got[name]
        if str(t.device) != device or t.dtype != want.dtype or t.shape != want.shape:
            out.append(
                f"rank {rank} {name}: {t.dtype} {tuple(t.shape)} on {t.device}, want {want.dtype} on {device}"
            )
        elif not torch.equal(
            t.cpu().contiguous().reshape(-1).view(torch.uint8),
            want.contiguous().reshape(-1).view(torch.uint8),
        ):
            out.append(f"rank {rank} {name}: bytes differ")
    return out


def _settled(gpu: torch.device) -> dict[str, Any]:
    """This rank's allocated CUDA memory and IPC counts, once nothing unreachable holds any."""
    gc.collect()  # (a caught error's traceback frames may hold a payload until collected)
    torch.cuda.synchronize(gpu)
    torch.cuda.ipc_collect()
    return {"allocated": torch.cuda.memory_allocated(gpu), **cuda_ipc.stats()}


def _gather_rounds(mine: dict[str, torch.Tensor], gpu: torch.device, report: dict[str, Any]) -> list[Any]:
    """Three config gathers (devices restored, ``device="cuda"``, ``device=<this GPU>``) and a tensor
    gather to ``"cuda"``; the first rank checks each and returns what it received."""
    from distribute_utils import get_configs_parallel, get_tensors_parallel

    kept: list[Any] = []
    rounds: list[tuple[str, Any]] = [
        ("restored", lambda: get_configs_parallel(mine, RANKS)),
        ("cuda", lambda: get_configs_parallel(mine, RANKS, device="cuda")),
        ("this-gpu", lambda: get_configs_parallel(mine, RANKS, device=gpu)),
        ("tensors", lambda: get_tensors_parallel(mine["bf16"], RANKS, device="cuda")),
    ]
    for name, gather in rounds:
        before = cuda_ipc.stats()
        with gather() as got:
            for r in RANKS[1:] if got else ():
                value = got[r] if name != "tensors" else {"bf16": got[r]}
                where = torch.device("cuda", r % torch.cuda.device_count()) if name == "restored" else gpu
                report["wrong"] += [f"{name}: {w}" for w in _wrong(value, r, str(where))]
            if got and name != "tensors":
                kept.append(got)
        after = cuda_ipc.stats()
        report["fetched"].append(after["fetched"] - before["fetched"])
        report["published"].append(after["published"] - before["published"])
    return kept


def _overwrite(value: dict[str, torch.Tensor]) -> None:
    """Overwrite every tensor of ``value`` in place (the very memory that was opened by IPC); no reference
    to any of them outlives the call (a loop variable left in the caller's frame kept one alive, seen on
    the H100 as 64 KiB still allocated)."""
    for t in value.values():
        if t.is_contiguous() and t.numel():
            t.view(torch.uint8).fill_(0xAB)
        elif t.numel():
            t.zero_()


def _exact_rounds() -> dict[str, Any]:
    rank, gpu = dist.get_rank(), _gpu()
    torch.cuda.set_device(gpu)
    base = _settled(gpu)
    mine = _values(rank, gpu)
    report: dict[str, Any] = {"base": base, "wrong": [], "fetched": [], "published": []}
    kept = _gather_rounds(mine, gpu, report)
    # The senders overwrite and free what they sent; the first rank's copies must not change.
    _overwrite(mine)
    torch.cuda.synchronize(gpu)
    del mine
    dist.barrier()
    report["wrong"] += [
        f"after the senders freed theirs: {w}"
        for got in kept
        for r in RANKS[1:]
        for w in _wrong(got[r], r, str(got[r]["bf16"].device))
    ]
    del kept
    dist.barrier()
    report["end"] = _settled(gpu)
    return report


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_travel_exactly_by_ipc_and_nothing_is_held(ranks4: RankPool) -> None:
    reports = ranks4.run(_exact_rounds)
    first = reports[0]
    assert first["wrong"] == [], first["wrong"]
    assert first["fetched"] == [3, 3, 3, 3], (
        f"rank 0 fetched by CUDA IPC per round: {first['fetched']} (want 3 each)"
    )
    for rank, report in enumerate(reports):
        if rank:
            assert report["published"] == [1, 1, 1, 1], (
                f"rank {rank} published by IPC per round: {report['published']}"
            )
        end, base = report["end"], report["base"]
        assert end["held"] == 0 and end["open"] == 0, f"rank {rank} still holds {end}"
        assert end["allocated"] == base["allocated"], (
            f"rank {rank}: torch.cuda.memory_allocated {end['allocated']} after the rounds, {base['allocated']} before"
        )


def _many_rounds(rounds: int) -> dict[str, Any]:
    from distribute_utils import get_configs_parallel

    rank, gpu = dist.get_rank(), _gpu()
    torch.cuda.set_device(gpu)
    value = {"w": torch.full((1 << 20,), float(rank), dtype=torch.bfloat16, device=gpu)}  # 2 MiB
    used: list[int] = []
    fetched = cuda_ipc.stats()["fetched"]
    wrong = 0
    for i in range(rounds):
        with get_configs_parallel(value, RANKS, device=gpu) as got:
            wrong += sum(int(not bool((got[r]["w"] == r).all())) for r in RANKS) if got else 0
        del got
        if i in (1, rounds - 1):
            dist.barrier()
            torch.cuda.synchronize(gpu)
            free, total = torch.cuda.mem_get_info(gpu)
            used.append(total - free)
    del value
    return {
        "used": used,
        "wrong": wrong,
        "fetched": cuda_ipc.stats()["fetched"] - fetched,
        "end": _settled(gpu),
    }


@pytest.mark.gpu
@needs_cuda
def test_many_ipc_rounds_do_not_grow_device_memory(ranks4: RankPool) -> None:
    rounds = 60
    reports = ranks4.run(_many_rounds, rounds)
    first = reports[0]
    assert first["wrong"] == 0, f"{first['wrong']} received tensors were wrong"
    assert first["fetched"] == 3 * rounds, (
        f"rank 0 fetched {first['fetched']} payloads by IPC in {rounds} rounds"
    )
    grown = first["used"][1] - first["used"][0]
    assert grown <= 64 * 2**20, (
        f"device memory in use grew by {grown / 2**20:.1f} MiB from round 2 to {rounds}"
    )
    for rank, report in enumerate(reports):
        assert report["end"]["held"] == 0 and report["end"]["open"] == 0, f"rank {rank}: {report['end']}"


def _faulty_round(gpu: torch.device) -> dict[str, Any]:
    """One config gather (30 s timeout) in which a rank dies: its outcome, time, and what this rank
    holds afterwards against before."""
    report: dict[str, Any] = {"base": _settled(gpu)}
    mine = _values(dist.get_rank(), gpu)
    start = time.monotonic()
    try:
        report.update(outcome="ok", wrong=_received_wrong(mine))
    except Exception as exc:
        report.update(outcome="error", error_type=type(exc).__name__, message=str(exc))
    report["elapsed"] = time.monotonic() - start
    del mine
    report["end"] = _settled(gpu)
    return report


def _received_wrong(mine: dict[str, torch.Tensor]) -> list[str]:
    from distribute_utils import get_configs_parallel

    with get_configs_parallel(mine, RANKS, timeout=30) as got:
        return [w for r in RANKS[1:] if got for w in _wrong(got[r], r, str(got[r]["bf16"].device))]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie, or reaped by the harness that started it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _sender_dies_after_publishing(signal_dir: str) -> dict[str, Any]:
    """Rank 3 publishes by IPC, then exits (``os._exit``) once rank 0 is fetching its payload; rank 0
    fetches only after it is dead."""
    rank, gpu = dist.get_rank(), _gpu()
    torch.cuda.set_device(gpu)
    pids: list[int] = [0] * 4
    dist.all_gather_object(pids, os.getpid())
    marker = Path(signal_dir) / "fetching3"
    if rank == 3:
        publish = CudaIpcTransport.publish

        def publish_then_die(self: CudaIpcTransport, token: str, r: int, payload: wire.EncodedPayload) -> Any:
            receipt = publish(self, token, r, payload)

            def die_when_fetched() -> None:
                deadline = time.monotonic() + 60
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                os._exit(17)

            threading.Thread(target=die_when_fetched, daemon=True).start()
            return receipt

        CudaIpcTransport.publish = publish_then_die  # type: ignore[method-assign,assignment]
    if rank == 0:
        fetch = CudaIpcTransport.fetch

        def fetch_after_death(self: CudaIpcTransport, token: str, r: int, receipt: Any) -> Any:
            if r == 3:
                marker.touch()
                deadline = time.monotonic() + 60
                while not _gone(pids[3]) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return fetch(self, token, r, receipt)

        CudaIpcTransport.fetch = fetch_after_death  # type: ignore[method-assign,assignment]
    return _faulty_round(gpu)


@pytest.mark.gpu
@needs_cuda
def test_sender_killed_after_publishing_by_ipc(fresh_job: Any, tmp_path: Path) -> None:
    reports = fresh_job(4).run(_sender_dies_after_publishing, str(tmp_path), expect_deaths=True, timeout=120)
    assert isinstance(reports[3], Died), f"rank 3 was to exit after publishing: {reports[3]}"
    first = reports[0]
    # Its memory went with it: the first rank names it (or, had the driver kept the mapping, got it intact).
    if first["outcome"] == "ok":
        assert first["wrong"] == [], first
    else:
        assert "rank 3" in first["message"], f"rank 0's error does not name rank 3: {first}"
        assert first["error_type"] in ("PeerLostError", "PayloadError"), first
    assert first["elapsed"] < 30, f"rank 0 took {first['elapsed']:.1f} s (the round's timeout is 30 s)"
    for rank in (0, 1, 2):
        end = reports[rank]["end"]
        assert end["held"] == 0 and end["open"] == 0, f"rank {rank} still holds {end}"
        assert end["allocated"] == reports[rank]["base"]["allocated"], (
            f"rank {rank}: {end} vs {reports[rank]['base']}"
        )
    if first["outcome"] == "error":
        for rank in (1, 2):
            assert reports[rank]["outcome"] == "error" and "rank 3" in reports[rank]["message"], reports[rank]


def _first_rank_dies_while_fetching() -> dict[str, Any]:
    """Rank 0 exits (``os._exit``) right after its first CUDA IPC fetch; the senders must not hang and
    must let go of their payloads."""
    rank, gpu = dist.get_rank(), _gpu()
    torch.cuda.set_device(gpu)
    if rank == 0:
        fetch = CudaIpcTransport.fetch

        def fetch_then_die(self: CudaIpcTransport, token: str, r: int, receipt: Any) -> Any:
            fetch(self, token, r, receipt)
            os._exit(17)

        CudaIpcTransport.fetch = fetch_then_die  # type: ignore[method-assign,assignment]
    return _faulty_round(gpu)


@pytest.mark.gpu
@needs_cuda
def test_first_rank_killed_while_fetching_by_ipc(fresh_job: Any) -> None:
    reports = fresh_job(4).run(_first_rank_dies_while_fetching, expect_deaths=True, timeout=120)
    assert isinstance(reports[0], Died), f"rank 0 was to exit while fetching: {reports[0]}"
    for rank in (1, 2, 3):
        report = reports[rank]
        assert report["outcome"] == "error" and report["error_type"] == "PeerLostError", (
            f"rank {rank}: {report}"
        )
        assert report["elapsed"] < 30, f"rank {rank} took {report['elapsed']:.1f} s (timeout 30 s)"
        end = report["end"]
        assert end["held"] == 0 and end["open"] == 0, f"rank {rank} still holds its payload: {end}"
        assert end["allocated"] == report["base"]["allocated"], (
            f"rank {rank}: torch.cuda.memory_allocated {end['allocated']} after, {report['base']['allocated']} before"
        )
