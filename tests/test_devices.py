"""Where gathered tensors land on the first rank: ModelOpt's rule, on real gloo ranks.

- ``get_tensors_parallel`` / ``gather_tensors``: every tensor on the CPU (ModelOpt's ``tensor.cpu()``);
- ``get_configs_parallel`` / ``gather_configs`` and :mod:`distribute_utils.modelopt`: the first rank's own
  config as passed (the same object), each received tensor on the device its sender had it on
  (``torch.load``'s restore); a device the first rank does not have raises ``DeviceUnavailableError``
  naming the tensor and the device, on every rank, before anything is yielded;
- ``device=`` overrides all of it; a meta tensor travels as its dtype and shape and stays meta.

A CPU-only machine has no CUDA sender: the sender stands for one by relabelling its payload's
entries (``harness.relabel_devices``, the bytes a CUDA sender writes but for the device names), put in
place of ``distribute_utils.wire.encode`` on that rank for one gather. The gpu-marked tests at the end
run the same with real CUDA tensors (4 gloo ranks sharing the GPUs there are).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import RankPool, relabel_devices

CUDA7 = "cuda:7"  # a device no test machine's first rank has (torch.load fails there too)


@contextlib.contextmanager
def sent_from(devices: dict[int, str]) -> Iterator[None]:
    """On this rank, for the block: payloads name ``devices`` (by tensor index) as their senders'."""
    from distribute_utils import wire

    encode = wire.encode

    def relabelled(obj: object, **kwargs: Any) -> wire.EncodedPayload:
        raw = relabel_devices(encode(obj, **kwargs).to_bytes(), devices)
        return wire.EncodedPayload(len(raw), raw)

    wire.encode = relabelled  # type: ignore[assignment]
    try:
        yield
    finally:
        wire.encode = encode  # type: ignore[assignment]


def _config(rank: int, meta: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {
        "rank": rank,
        "layers": [{"w": torch.full((2,), float(rank))}, {"w": torch.arange(3.0) + rank}],
    }
    if meta:
        config["meta"] = torch.empty(rank + 1, 4, dtype=torch.bfloat16, device="meta")
    return config


def _attempt(gather: Callable[[], Any]) -> dict[str, Any]:
    """Run one gather (a context manager factory); what it yielded inside the block, or its error."""
    entered = False
    try:
        with gather() as got:
            entered = True
            return {"got": got, "error": None}
    except Exception as exc:
        return {"entered": entered, "error": type(exc).__name__, "message": str(exc)}


def _placement() -> dict[str, Any]:
    from distribute_utils import get_configs_parallel, get_tensors_parallel
    from distribute_utils import modelopt as compat

    rank = dist.get_rank()
    own = _config(rank, meta=True)
    out: dict[str, Any] = {}
    for name, gather in (("ours", get_configs_parallel), ("compat", compat.get_configs_parallel)):
        with gather(own, [0, 1, 2, 3], None) as got:
            if got:
                out[name] = {
                    "own_is_passed": got[0] is own,
                    "devices": [[str(c["layers"][i]["w"].device) for i in (0, 1)] for c in got],
                    "values": [c["layers"][1]["w"].tolist() for c in got],
                    "meta": [(c["meta"].is_meta, tuple(c["meta"].shape), str(c["meta"].dtype)) for c in got],
                }
    with get_configs_parallel(own, [0, 1, 2, 3], device="cpu") as got:
        if got:  # device= places the first rank's own config too: moved copies where tensors move
            out["cpu_own_is_passed"] = got[0] is own
            out["cpu_meta_stays_meta"] = all(c["meta"].is_meta for c in got)
    meta = torch.empty(rank + 2, dtype=torch.float16, device="meta")
    for name, gather in (("tensors", get_tensors_parallel), ("compat_tensors", compat.get_tensors_parallel)):
        with gather(meta, [0, 1, 2, 3], None) as got:
            if got:
                out[name] = [(t.is_meta, tuple(t.shape)) for t in got]
    return out


def test_own_config_as_passed_received_where_sent_meta_stays_meta(ranks4: RankPool) -> None:
    results = ranks4.run(_placement)
    first = results[0]
    for name in ("ours", "compat"):
        r = first[name]
        assert r["own_is_passed"] is True, name
        assert r["devices"] == [["cpu", "cpu"]] * 4, name
        assert r["values"] == [[float(k + rank) for k in range(3)] for rank in range(4)], name
        assert r["meta"] == [(True, (rank + 1, 4), "torch.bfloat16") for rank in range(4)], name
    assert first["cpu_own_is_passed"] is True  # nothing to move: a CPU config stays the same object
    assert first["cpu_meta_stays_meta"] is True
    assert first["tensors"] == first["compat_tensors"] == [(True, (rank + 2,)) for rank in range(4)]
    assert all(r == {} for r in results[1:])


def _from_a_missing_device(how: str, workspace: str | None) -> dict[str, Any]:
    """Rank 2's ``config['layers'][1]['w']`` (tensor 1) comes from ``cuda:7``; then a plain gather."""
    from distribute_utils import get_configs_parallel, get_tensors_parallel
    from distribute_utils import modelopt as compat

    rank = dist.get_rank()
    config = _config(rank)

    def gather() -> Any:
        if how == "ours":
            return get_configs_parallel(config, [0, 1, 2, 3])
        if how == "ours_cpu":
            return get_configs_parallel(config, [0, 1, 2, 3], device="cpu")
        if how == "compat":
            return compat.get_configs_parallel(config, [0, 1, 2, 3], None, workspace)
        return get_tensors_parallel(config["layers"][1]["w"], [0, 1, 2, 3])  # tensor 0 of its payload

    relabel = {0: CUDA7} if how == "tensors" else {1: CUDA7}
    with sent_from(relabel) if rank == 2 else contextlib.nullcontext():
        outcome = _attempt(gather)
    got = outcome.pop("got", None)
    if got:
        picked = [c if how == "tensors" else c["layers"][1]["w"] for c in got]
        outcome["received"] = [(str(t.device), t.tolist()) for t in picked]
    with get_configs_parallel(config, [0, 1, 2, 3]) as again:
        outcome["next"] = [c["rank"] for c in again]
    return outcome


@pytest.mark.parametrize("how", ["ours", "compat"])
def test_a_sender_device_the_first_rank_lacks_fails_every_rank_naming_path_and_device(
    ranks4: RankPool, how: str
) -> None:
    results = ranks4.run(_from_a_missing_device, how, None)
    for rank, r in enumerate(results):
        assert r["error"] == "DeviceUnavailableError" and r["entered"] is False, (rank, r)
        assert "rank 2's config['layers'][1]['w'] is on cuda:7" in r["message"], (rank, r)
    assert "torch.load would fail here too" in results[0]["message"]
    assert results[0]["next"] == [0, 1, 2, 3]  # nothing stuck: the next gather works


@pytest.mark.parametrize("how", ["ours_cpu", "tensors", "workspace"])
def test_where_modelopt_maps_to_the_cpu_the_missing_device_does_not_matter(
    ranks4: RankPool, how: str, tmp_path: Any
) -> None:
    """``device="cpu"`` overrides the sender's device; ``get_tensors_parallel`` yields the CPU
    (ModelOpt's ``tensor.cpu()``); ModelOpt's workspace path loads with ``map_location="cpu"``."""
    workspace = str(tmp_path) if how == "workspace" else None
    results = ranks4.run(_from_a_missing_device, "compat" if workspace else how, workspace)
    assert results[0]["error"] is None, results[0]
    expected = [("cpu", (torch.arange(3.0) + rank).tolist()) for rank in range(4)]
    assert results[0]["received"] == expected
    assert all(r["error"] is None and "received" not in r for r in results[1:])


# --------------------------------------------------------------------------- on a GPU


def _local_gpu() -> torch.device:
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())


def _cuda_placement() -> dict[str, Any]:
    from distribute_utils import get_configs_parallel, get_tensors_parallel
    from distribute_utils import modelopt as compat

    rank, gpu = dist.get_rank(), _local_gpu()
    own = {"w": torch.arange(6.0, device=gpu).reshape(2, 3)[:, 1:] + rank, "s": torch.ones(1) * rank}
    out: dict[str, Any] = {"gpu": str(gpu)}

    def seen(got: list[Any]) -> list[Any]:
        return [(str(c["w"].device), str(c["s"].device), c["w"].cpu().tolist()) for c in got]

    for name, gather in (("ours", get_configs_parallel), ("compat", compat.get_configs_parallel)):
        with gather(own, [0, 1, 2, 3], None) as got:
            if got:
                out[name] = seen(got)
                out[f"{name}_own_is_passed"] = got[0] is own
    with get_configs_parallel(own, [0, 1, 2, 3], device="cpu") as got:
        if got:
            out["cpu"] = seen(got)
    for name, gather in (("tensors", get_tensors_parallel), ("compat_tensors", compat.get_tensors_parallel)):
        with gather(own["w"], [0, 1, 2, 3], None) as got:
            if got:
                out[name] = [str(t.device) for t in got]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_cuda_configs_are_received_on_their_senders_devices(ranks4: RankPool) -> None:
    results = ranks4.run(_cuda_placement)
    first, gpus = results[0], [r["gpu"] for r in results]
    values = [[[1.0 + rank, 2.0 + rank], [4.0 + rank, 5.0 + rank]] for rank in range(4)]
    for name in ("ours", "compat"):
        assert first[name] == [(gpus[rank], "cpu", values[rank]) for rank in range(4)], name
        assert first[f"{name}_own_is_passed"] is True, name
    assert first["cpu"] == [("cpu", "cpu", values[rank]) for rank in range(4)]
    assert first["tensors"] == first["compat_tensors"] == ["cpu"] * 4


class _Rows(list):  # type: ignore[type-arg]  # a list subclass, as a user's config may hold
    pass


def _subclass_on_the_first_rank(device: str | None, kind: str) -> tuple[str, str]:
    from collections import defaultdict

    from distribute_utils import get_configs_parallel

    rank = dist.get_rank()
    tensors = [torch.ones(2) * rank]
    held: Any = list(tensors)
    if rank == 0:  # (only the first rank: its own value is never encoded, the senders' are fine)
        held = _Rows(tensors) if kind == "list" else defaultdict(list, {"t": tensors})
    try:
        with get_configs_parallel({"layers": [{"w": held}]}, [0, 1, 2, 3], device=device, timeout=60):
            return ("no error", "")
    except Exception as exc:
        return (type(exc).__name__, str(exc))


@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize("device", [None, "cpu", "meta"])
def test_a_container_subclass_is_refused_on_the_first_rank_as_a_sender_would(
    ranks4: RankPool, device: str | None, kind: str
) -> None:
    """A subclass of ``list`` (or a ``defaultdict``) in the first rank's own config: a sender's encode
    would refuse it (no copy could keep its type); the first rank, whose own value is never encoded,
    refuses it the same way, naming the path, whether its tensors move (``device="meta"``: before, a
    TypeError from building the subclass, or a wrong value) or not (before, it went through), and every
    sender hears that error as its own type."""
    results = ranks4.run(_subclass_on_the_first_rank, device, kind)
    error, message = results[0]
    assert error == "UnsupportedTypeError", results[0]
    assert "config['layers'][0]['w']: cannot encode a value of type" in message, message
    assert ("_Rows" in message) if kind == "list" else ("defaultdict" in message), message
    for rank in (1, 2, 3):
        assert results[rank][0] == "UnsupportedTypeError", results[rank]
        assert results[rank][1].startswith("the first rank (0) failed: "), results[rank]
