"""CUDA tensors gathered to rank 0's GPU, whole round, beside the copy limits measured in the same run.

Issue 35's cases, on ``--nproc`` local ranks (gloo) that share one GPU (``--device``, default
``cuda:0``):

- ``256M`` (and the other sizes): one bf16 CUDA tensor of that many bytes per rank;
- ``layer``: one decoder layer's config per rank, as ModelOpt's FP8 export holds it on a TP4 rank
  (Qwen3-style: QKV biases, QK norms, weight, activation and KV-cache scales: 30 CUDA tensors, 104
  MiB at ``--layer-hidden 4096``): ModelOpt's ``DecoderLayerConfig`` where ``nvidia-modelopt``
  imports, else the same tree as plain dicts (see :func:`layer_config` for why not more tensors).

Every repetition runs every method once, in an order shuffled per repetition (the same on every
rank), after a ``dist.barrier()``; each rank stamps its entry and return on ``CLOCK_MONOTONIC``, and
rank 0 reads every byte it received (its own value's too) with a checksum computed on the GPU
(each tensor's int64 words summed, weighted by its place among all ranks' tensors, modulo 2**64;
checked against the sum of every rank's own checksum) and checks that every tensor is where the
method puts it and that ours went by the route it names, before its
return stamp. ``all done`` is from the first rank's entry to the last rank's return. Methods:

- ``ours_cuda``: ours with ``device=<the GPU>`` (``transport="auto"``: the CUDA IPC route, on one host);
- ``ours_shm``: the same through shared memory (``transport="shm"``: registered segments and maps);
- ``ours_then_cuda``: ours with the default device, then ``.to(<the GPU>)`` of every tensor (for a
  config, the default already puts each received tensor on its sender's GPU: the IPC route);
- ``collective``: ours with ``transport="collective"`` (gloo) and ``device=<the GPU>``;
- ``modelopt``: ModelOpt's helpers (``get_tensors_parallel`` / ``get_configs_parallel``), then
  ``.to(<the GPU>)`` (when ``nvidia-modelopt`` imports);
- ``gather``: ``dist.gather`` (gloo) of each tensor's ``.cpu()`` copy into preallocated outputs,
  then ``.to(<the GPU>)``;
- ``shm_floor``: the registered-memory limit of the case: each sender copies its tensors device to
  host into its own warm ``/dev/shm`` mapping, registered with ``cudaHostRegister`` (pinned) once,
  and sends one gloo message to rank 0, which has the same files mapped and registered and copies
  each sender's mapping host to device as its message comes. No checks, no verdict;
- ``ipc_floor``: the CUDA IPC limit of the case: rank 0 opened every sender's tensors once (the
  storage IPC handles ``torch.multiprocessing.reductions.reduce_tensor`` makes); each round a sender
  sends one gloo message and rank 0 copies its tensors device to device into buffers of its own. It
  runs after the other methods, in a phase of its own: while its mappings are open, ours would find
  the same allocations already open (a second open only counts a reference) and pay no open.

Beside them, in one process, at the largest size asked (64 MiB if only ``layer`` is): pageable
``x.cpu()``, pageable ``copy_`` each way, pinned ``copy_`` each way, a ``/dev/shm`` mapping
registered with ``cudaHostRegister`` each way, and a device-to-device copy; and per case, rank 0's
device-to-device copy of every sender's tensors from its IPC mappings alone (``ipc copy``).

    python scripts/bench_gpu.py                          # 256M and layer, 4 ranks, 5 rounds each
    python scripts/bench_gpu.py --sizes 256M --reps 3 --json out.json
    python scripts/bench_gpu.py --device cpu --sizes 1M layer --layer-hidden 256 --nproc 2 --reps 1

Prints each case's table (median all done, its 10th/90th percentile, rank 0's own time, GiB/s
received) and ratios of those medians, with the device's name; ``--json`` writes everything.
``--device cpu`` is a dry run of the machinery for machines without a GPU (the tests): no
registration, no IPC, figures that mean nothing. Without CUDA and without ``--device cpu`` the
script says so in one line and exits with status 2. Exit status 1: a case failed (its error is
printed; the other cases ran).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import mmap
import os
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_latency import summarise  # whole-round figures from every rank's stamps

from distribute_utils import get_configs_parallel, get_tensors_parallel
from distribute_utils.launch import LaunchError, run_local
from distribute_utils.transports import cuda_ipc

SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20, "1G": 1 << 30}
CASES = [*SIZES, "layer"]
DEFAULT_CASES = ["256M", "layer"]
METHODS = [
    "ours_cuda",
    "ours_shm",
    "ours_then_cuda",
    "collective",
    "modelopt",
    "gather",
    "shm_floor",
    "ipc_floor",
]
#: Ratios of median ``all done`` times printed per case (a/b), with the issue's target where it has one.
RATIOS: list[tuple[str, str, str]] = [
    ("ours_shm", "shm_floor", "target <= 1.5"),
    ("ours_cuda", "ipc_floor", ""),
    ("ours_shm", "ours_cuda", ""),
    ("ours_then_cuda", "ours_cuda", ""),
    ("collective", "ours_cuda", ""),
    ("modelopt", "ours_cuda", ""),
    ("gather", "ours_cuda", ""),
]
IPC_TARGET_MS = 5.0  # issue 35: through IPC within 5 ms (the 4 x 256 MiB case on an H100)
ALIGN = 64  # byte alignment of each tensor in a floor's mapping
MOD = 1 << 64  # checksums add up modulo 2**64, as int64 sums wrap
SEGMENT_PREFIX = "/dev/shm/du-bench-gpu-"
# One round's stamps on one rank: entry and return (ns, CLOCK_MONOTONIC) and process CPU in between (ns).
Stamp = tuple[int, int, int]


# -- pure helpers (tested on the CPU) -------------------------------------------------------------------
def checksum(tensors: Iterable[torch.Tensor], start: int = 0) -> int:
    """Tensor ``start + i``'s bytes read as int64 words (single bytes where its size is no multiple of
    8) and summed, times ``start + i + 1``, summed over the tensors modulo 2**64: a read of every byte,
    computed on the tensors' own devices with one transfer of the result per device. Tensors that
    arrive in another order, or from another rank, give another sum (a rank's ``n`` tensors are numbered
    from ``rank * n``); within one tensor it is a plain sum."""
    parts: dict[torch.device, list[torch.Tensor]] = {}
    for i, t in enumerate(tensors, start + 1):
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
        if raw.numel() % 8 == 0:
            words = (raw if raw.storage_offset() % 8 == 0 else raw.clone()).view(torch.int64)
        else:
            words = raw
        parts.setdefault(raw.device, []).append(words.sum(dtype=torch.int64) * i)
    return sum(int(torch.stack(sums).sum()) % MOD for sums in parts.values()) % MOD


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in one buffer (each :data:`ALIGN`-aligned), and the buffer's size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor of a config tree (dicts, lists, tuples, dataclasses), in the tree's order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        children: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = (getattr(value, f.name) for f in dataclasses.fields(value))
    else:
        return []
    return [t for child in children for t in tensors_of(child)]


def gib_per_s(nbytes: int, ms: float) -> float:
    """``nbytes`` moved in ``ms`` milliseconds, in GiB/s."""
    return nbytes / 2**30 / (ms / 1e3)


def ratios(medians: dict[str, float], pairs: Iterable[tuple[str, str, str]]) -> dict[str, float]:
    """``{"a/b": medians[a] / medians[b]}`` for each pair whose both methods ran."""
    return {f"{a}/{b}": medians[a] / medians[b] for a, b, _ in pairs if a in medians and medians.get(b)}


def dict_node(kind: str, **fields: Any) -> dict[str, Any]:
    """A config node as a plain dict (``kind``, ModelOpt's class name, is dropped)."""
    del kind
    return dict(fields)


def modelopt_node(kind: str, **fields: Any) -> Any:
    """A config node as ModelOpt's dataclass ``kind`` (``modelopt.torch.export.model_config``)."""
    from modelopt.torch.export import model_config as mc  # type: ignore[import-untyped]

    return getattr(mc, kind)(**fields)


def layer_config(
    hidden: int, seed: int, device: torch.device | str, node: Callable[..., Any] = dict_node
) -> Any:
    """One decoder layer's config on a TP4 rank as ModelOpt's FP8 export holds it (Qwen3-style: 32
    heads, 8 KV heads, FFN 3.5 x ``hidden``, QKV biases, QK norms, FP8 weight, activation and KV-cache
    scales): 30 random tensors on ``device`` (bf16, float32 scales). ``node(kind, **fields)`` makes each
    node: :func:`dict_node` or :func:`modelopt_node`. ``hidden``: a multiple of 32.

    Not more tensors: ModelOpt's ``get_configs_parallel`` sizes its segment at 2 KiB per tensor beyond
    the bytes, and ``torch.load`` finds a zip's end only within its last 64 KiB, so it cannot read back
    a config of more than about 35 tensors ("failed finding central directory")."""
    tp, heads, kv_heads = 4, 32, 8
    head = hidden // heads
    q_rows, kv_rows, ffn_rows = heads // tp * head, kv_heads // tp * head, hidden * 7 // 2 // tp
    gen = torch.Generator(device=device).manual_seed(seed)

    def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    def linear(kind: str, rows: int, cols: int, bias: bool = False) -> Any:
        return node(
            "LinearConfig",
            linear_type=kind,
            quantization="fp8",
            weight=t(rows, cols),
            bias=t(rows) if bias else None,
            activation_scaling_factor=t(dtype=torch.float32),
            weights_scaling_factor=t(dtype=torch.float32),
        )

    def norm(size: int) -> Any:
        return node("LayernormConfig", weight=t(size))

    qkv = node(
        "QKVConfig",
        q=linear("column", q_rows, hidden, bias=True),
        k=linear("column", kv_rows, hidden, bias=True),
        v=linear("column", kv_rows, hidden, bias=True),
    )
    attention = node(
        "AttentionConfig",
        qkv=qkv,
        dense=linear("row", hidden, q_rows),
        k_cache_scaling_factor=t(dtype=torch.float32),
        v_cache_scaling_factor=t(dtype=torch.float32),
        kv_cache_dtype="fp8",
        q_layernorm=norm(head),
        k_layernorm=norm(head),
    )
    mlp = node(
        "MLPConfig",
        fc=linear("column", ffn_rows, hidden),
        gate=linear("column", ffn_rows, hidden),
        proj=linear("row", hidden, ffn_rows),
        hidden_act="silu",
    )
    return node(
        "DecoderLayerConfig",
        decoder_type="qwen",
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        input_layernorm=norm(hidden),
        post_layernorm=norm(hidden),
        attention=attention,
        mlp=mlp,
    )


def tensor_payload(nbytes: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """A random bf16 tensor of ``nbytes`` bytes (rows of 8192 where it is that large) on ``device``."""
    cols = min(8192, nbytes // 2)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((nbytes // 2 // cols, cols), generator=gen, device=device, dtype=torch.bfloat16)


# -- shared memory and CUDA ---------------------------------------------------------------------------
class Segment:
    """A ``/dev/shm`` file of ``size`` bytes mapped in this process (``view``: a uint8 tensor over it),
    registered with the CUDA runtime on request. Whoever made it calls :meth:`close`."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)
            self.map: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.view: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = False

    def register(self) -> str | None:
        """Pin the mapping with ``cudaHostRegister`` (portable); why not, or None when done."""
        assert self.view is not None
        code = int(torch.cuda.cudart().cudaHostRegister(self.view.data_ptr(), self.view.numel(), 1))
        self.registered = code == 0
        return None if self.registered else f"cudaHostRegister returned CUDA error {code}"

    def close(self) -> None:
        if self.registered and self.view is not None:
            torch.cuda.cudart().cudaHostUnregister(self.view.data_ptr())
            self.registered = False
        self.view = None
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: unmapped at exit
                self.map.close()
            self.map = None


def _remove_segments(prefix: str) -> None:
    """The launching process, at the end however it came: remove what failed ranks left of this run's."""
    for path in glob.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_ms(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` (device work included) over ``reps`` calls after one untimed."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter_ns()
        fn()
        _sync(device)
        times.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(times)


def copy_rates(
    nbytes: int, reps: int, device: torch.device, prefix: str
) -> dict[str, dict[str, float] | str]:
    """One process's copy rates of ``nbytes`` between ``device`` and the host, each way, per kind of host
    memory, and device to device: ``{name: {"ms": median, "GiB/s": rate}}`` (or why it was not measured).
    Its ``/dev/shm`` file is named ``prefix`` + ``rates``."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    y = torch.empty_like(x)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    plan: dict[str, Callable[[], Any]] = {
        "pageable x.cpu()": x.cpu,
        "pageable copy_ D2H": lambda: pageable.copy_(x),
        "pageable copy_ H2D": lambda: y.copy_(pageable),
        "pinned copy_ D2H": lambda: pinned.copy_(x, non_blocking=True),
        "pinned copy_ H2D": lambda: y.copy_(pinned, non_blocking=True),
    }
    out: dict[str, dict[str, float] | str] = {}
    path = f"{prefix}rates"
    segment = Segment(path, nbytes, create=True)
    try:
        os.unlink(path)  # mapped: nothing need stay in /dev/shm
        registered = segment.view
        assert registered is not None
        registered.fill_(1)  # every page written once
        why = segment.register()
        if why is None:
            plan["registered /dev/shm D2H"] = lambda: registered.copy_(x, non_blocking=True)
            plan["registered /dev/shm H2D"] = lambda: y.copy_(registered, non_blocking=True)
        else:
            out["registered /dev/shm"] = why
        plan["device-to-device"] = lambda: y.copy_(x)
        for name, fn in plan.items():
            ms = _timed_ms(fn, reps, device)
            out[name] = {"ms": ms, "GiB/s": gib_per_s(nbytes, ms)}
    finally:
        plan.clear()  # (the view, held by this frame too, lets the mapping go at return)
        segment.close()
    return out


class ShmFloor:
    """The registered-memory floor of one case (see the module doc); made and closed on every rank."""

    def __init__(
        self, tensors: list[torch.Tensor], device: torch.device, prefix: str, notes: list[str]
    ) -> None:
        self.tensors, self.device = tensors, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.offsets, size = layout(tensors)
        self.segments: dict[int, Segment] = {}
        self.staging: dict[int, torch.Tensor] = {}  # rank 0: a device buffer per sender
        self.signal = torch.zeros(1, dtype=torch.int64)
        if self.rank != 0:
            self.segments[self.rank] = Segment(f"{prefix}{self.rank}", size, create=True)
        dist.barrier()
        if self.rank == 0:
            for r in range(1, self.world):
                self.segments[r] = Segment(f"{prefix}{r}", size, create=False)
                if device.type != "cpu":
                    self.staging[r] = torch.empty(size, dtype=torch.uint8, device=device)
        dist.barrier()
        if self.rank != 0:
            os.unlink(f"{prefix}{self.rank}")  # mapped at both ends: nothing need stay in /dev/shm
        for segment in self.segments.values():
            assert segment.view is not None
            segment.view.fill_(0)  # every page written once
            why = segment.register() if device.type == "cuda" else None
            if why is not None:
                notes.append(f"rank {self.rank}: {why}; its shm floor copies pageable memory")

    def _pieces(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[o : o + t.numel() * t.element_size()] for o, t in zip(self.offsets, self.tensors)]

    def run(self, check: Callable[[str, int], None]) -> None:
        if self.rank != 0:
            view = self.segments[self.rank].view
            assert view is not None
            for piece, t in zip(self._pieces(view), self.tensors):
                piece.copy_(as_bytes(t), non_blocking=True)
            _sync(self.device)
            dist.send(self.signal, dst=0)
            return
        total = checksum(self.tensors)
        for _ in range(1, self.world):
            sender = dist.recv(self.signal)  # from whichever sender is done first
            buffer = self.segments[sender].view
            assert buffer is not None
            if sender in self.staging:
                buffer = self.staging[sender].copy_(buffer, non_blocking=True)
            total += checksum(self._pieces(buffer), sender * len(self.tensors))
        check("shm_floor", total % MOD)

    def close(self) -> None:
        _sync(self.device)
        dist.barrier()
        self.staging.clear()
        for segment in self.segments.values():
            segment.close()


class IpcFloor:
    """The CUDA IPC floor of one case (see the module doc); made by :func:`open_ipc` on every rank."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device, handles: list[Any] | None) -> None:
        self.tensors, self.device = tensors, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.signal = torch.zeros(1, dtype=torch.int64)
        self.remote: dict[int, list[torch.Tensor]] = {}  # rank 0: each sender's tensors, mapped
        self.copies: dict[int, list[torch.Tensor]] = {}  # rank 0: its own buffers for them
        for r, sent in enumerate(handles or []):
            if r != 0:
                self.remote[r] = [rebuild(*args) for rebuild, args in sent]
                self.copies[r] = [torch.empty_like(t) for t in self.remote[r]]

    def _copy(self, sender: int) -> list[torch.Tensor]:
        for mine, theirs in zip(self.copies[sender], self.remote[sender]):
            mine.copy_(theirs, non_blocking=True)
        return self.copies[sender]

    def run(self, check: Callable[[str, int], None]) -> None:
        if self.rank != 0:
            _sync(self.device)  # (written long before; a real route records an event instead)
            dist.send(self.signal, dst=0)
            return
        total = checksum(self.tensors)
        for _ in range(1, self.world):
            sender = dist.recv(self.signal)
            total += checksum(self._copy(sender), sender * len(self.tensors))
        check("ipc_floor", total % MOD)

    def copy_ms(self, reps: int) -> float | None:
        """Rank 0: the median time of copying every sender's tensors device to device from its mappings
        (no messages, no reads); None elsewhere. Entered on every rank."""
        ms = None
        if self.rank == 0:
            ms = _timed_ms(lambda: [self._copy(r) for r in self.remote], reps, self.device)
        dist.barrier()
        return ms

    def close(self) -> None:
        self.remote.clear()
        self.copies.clear()
        _sync(self.device)
        dist.barrier()  # rank 0 let go of the mappings before the senders free their tensors
        if self.rank != 0:
            torch.cuda.ipc_collect()


def open_ipc(tensors: list[torch.Tensor], device: torch.device, notes: list[str]) -> IpcFloor | None:
    """Every rank: the IPC floor, or None on every rank (the reason in rank 0's ``notes``) when a sender
    could not share its tensors or rank 0 could not open them."""
    from torch.multiprocessing.reductions import reduce_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    error: str | None = None
    mine: list[Any] | None = None
    if rank != 0:
        try:
            mine = [reduce_tensor(t) for t in tensors]
        except Exception as exc:
            error = f"rank {rank} could not share its tensors: {type(exc).__name__}: {exc}"
    handles: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, handles, dst=0)
    floor = None
    if handles is None or all(h is not None for h in handles[1:]):
        try:
            floor = IpcFloor(tensors, device, handles)
        except Exception as exc:
            error = f"rank {rank} could not open the IPC handles: {type(exc).__name__}: {exc}"
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if not failed and floor is not None:
        return floor
    if floor is not None:
        floor.close()
    else:
        dist.barrier()  # the barrier close() would have passed
    if rank == 0:
        notes.append(f"no ipc_floor: {failed[0] if failed else 'a sender shared nothing'}")
    return None


# -- one case on one rank ----------------------------------------------------------------------------
def _modelopt() -> Any | None:
    try:
        import modelopt.torch.export.distribute as mo_dist  # type: ignore[import-untyped]
    except Exception:
        return None
    return mo_dist


def _on_every_rank(flag: bool) -> bool:
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


class _Check:
    """Rank 0's expected checksum of a round: the sum of every rank's own."""

    def __init__(self, mine: int) -> None:
        sums: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(sums, mine)
        self.want = sum(sums) % MOD

    def __call__(self, method: str, got: int) -> None:
        if got != self.want:
            raise RuntimeError(f"{method}: rank 0 read checksum {got:#x}, expected {self.want:#x}")


def _round(fn: Callable[[], None], device: torch.device) -> Stamp:
    """Device idle, a barrier, then this rank's entry and return stamps around ``fn`` and its process CPU."""
    _sync(device)
    dist.barrier()
    cpu, start = time.process_time_ns(), time.perf_counter_ns()
    fn()
    end = time.perf_counter_ns()
    return start, end, time.process_time_ns() - cpu


def _interleaved(
    methods: dict[str, Callable[[], None]], reps: int, device: torch.device
) -> dict[str, list[Stamp]]:
    """One untimed round of every method, then ``reps`` repetitions of every method in an order
    shuffled per repetition (the same on every rank)."""
    for fn in methods.values():
        _round(fn, device)
    stamps: dict[str, list[Stamp]] = {m: [] for m in methods}
    names = list(methods)
    for rep in range(reps):
        for method in random.Random(rep).sample(names, len(names)):
            stamps[method].append(_round(methods[method], device))
    return stamps


def _methods(
    value: Any,
    tensors: list[torch.Tensor],
    device: torch.device,
    modelopt: Any | None,
    shm: ShmFloor,
    check: _Check,
) -> dict[str, Callable[[], None]]:
    """The case's methods on this rank (the same names on every rank), in :data:`METHODS`' order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    lone = isinstance(value, torch.Tensor)
    gather = get_tensors_parallel if lone else get_configs_parallel

    def read(name: str, got: list[Any], move: bool) -> None:
        found = [t for v in got for t in tensors_of(v)]
        if not move:
            elsewhere = sorted({str(t.device) for t in found if t.device != device})
            if elsewhere:
                raise RuntimeError(f"{name}: rank 0 received tensors on {elsewhere}, not {device}")
        check(name, checksum([t.to(device) for t in found] if move else found))

    def ours(name: str, move: bool, ipc: int | None = None, **options: Any) -> Callable[[], None]:
        """Ours with ``options``; on a GPU, rank 0 checks that ``ipc`` payloads came by CUDA IPC (None:
        not checked)."""

        def call() -> None:
            before = cuda_ipc.stats()["fetched"]
            with gather(value, ranks, **options) as got:
                if rank == 0:
                    read(name, got, move)
            fetched = cuda_ipc.stats()["fetched"] - before
            if rank == 0 and ipc is not None and device.type == "cuda" and fetched != ipc:
                raise RuntimeError(f"{name}: {fetched} payloads came by CUDA IPC, not {ipc}")

        return call

    methods = {
        "ours_cuda": ours("ours_cuda", False, world - 1, device=device),
        "ours_shm": ours("ours_shm", False, 0, transport="shm", device=device),
        "ours_then_cuda": ours("ours_then_cuda", True),
        "collective": ours("collective", False, 0, transport="collective", device=device),
    }
    if modelopt is not None:

        def theirs() -> None:
            if lone:
                calling = modelopt.get_tensors_parallel(value, ranks)
            else:
                calling = modelopt.get_configs_parallel(value, ranks, None)
            with calling as got:
                if rank == 0:
                    read("modelopt", got, True)

        methods["modelopt"] = theirs
    outputs = (
        [[torch.empty(t.nbytes, dtype=torch.uint8) for t in tensors] for _ in ranks] if rank == 0 else None
    )

    def gathered() -> None:
        for i, t in enumerate(tensors):
            dist.gather(as_bytes(t.cpu()), [o[i] for o in outputs] if outputs else None, dst=0)
        if outputs is not None:
            check("gather", checksum([o.to(device) for row in outputs for o in row]))

    methods["gather"] = gathered
    methods["shm_floor"] = lambda: shm.run(check)
    return methods


def _case(case: str, reps: int, device_name: str, hidden: int, prefix: str) -> dict[str, Any]:
    """One rank's part in one case: its stamps per method, and (rank 0) what it saw. Its ``/dev/shm``
    files are named ``prefix`` + the case + ``-``."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    modelopt = _modelopt()
    if not _on_every_rank(modelopt is not None):
        modelopt = None
    if case == "layer":
        value: Any = layer_config(hidden, 100 + rank, device, modelopt_node if modelopt else dict_node)
        payload = f"{'ModelOpt DecoderLayerConfig' if modelopt else 'dict'} (hidden {hidden})"
    else:
        value, payload = tensor_payload(SIZES[case], 100 + rank, device), "bf16 tensor"
    tensors = tensors_of(value)
    check = _Check(checksum(tensors, rank * len(tensors)))
    notes: list[str] = [] if modelopt else ["no modelopt: nvidia-modelopt does not import"]
    shm = ShmFloor(tensors, device, f"{prefix}{case}-", notes)
    # No collective clean-up after a failure (the other ranks are elsewhere: it would hang): the failing
    # rank reports, run_local stops the others, and what they hold goes with their processes.
    stamps = _interleaved(_methods(value, tensors, device, modelopt, shm, check), reps, device)
    shm.close()
    # The IPC floor keeps every sender's memory opened in rank 0 for its rounds: a second open of the
    # same allocation in that process only counts a reference, so ours would pay no open while they
    # are. It runs in a phase of its own, after every other method.
    ipc = open_ipc(tensors, device, notes) if device.type == "cuda" else None
    ipc_ms = None
    if ipc is not None:
        stamps.update(_interleaved({"ipc_floor": lambda: ipc.run(check)}, reps, device))
        ipc_ms = ipc.copy_ms(max(reps, 3))
        ipc.close()
    report: dict[str, Any] = {"stamps": stamps}
    if rank == 0:
        report.update(
            payload=payload,
            tensors=len(tensors),
            bytes_per_rank=sum(t.numel() * t.element_size() for t in tensors),
            ipc_copy_ms=ipc_ms,
            notes=notes,
        )
    else:
        report["notes"] = notes
    return report


def _machine(device_name: str, nbytes: int, reps: int, prefix: str) -> dict[str, Any]:
    """The machine's versions and device, and (on a GPU) :func:`copy_rates` at ``nbytes``."""
    device = torch.device(device_name)
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device_name": "CPU (dry run)",
        "rates": {},
        "rate_bytes": nbytes,
    }
    if device.type == "cuda":
        torch.cuda.set_device(device)
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = torch.cuda.get_device_name(device)
        info["capability"] = f"{props.major}.{props.minor}"
        info["memory_gib"] = props.total_memory / 2**30
        info["rates"] = copy_rates(nbytes, reps, device, prefix)
    return info


# -- the launching process ---------------------------------------------------------------------------
def _case_report(per_rank: list[dict[str, Any]], nproc: int) -> dict[str, Any]:
    first = per_rank[0]
    summary = summarise([r["stamps"] for r in per_rank])
    medians = {m: v["all done"][1] for m, v in summary.items()}
    received = first["bytes_per_rank"] * (nproc - 1)
    return {
        "payload": first["payload"],
        "tensors": first["tensors"],
        "bytes_per_rank": first["bytes_per_rank"],
        "received_bytes": received,
        "reps": len(next(iter(first["stamps"].values()))),
        "summary": summary,
        "gib_per_s_received": {m: gib_per_s(received, ms) for m, ms in medians.items()},
        "ratios": ratios(medians, RATIOS),
        "ipc_copy_ms": first["ipc_copy_ms"],
        "notes": sorted({n for r in per_rank for n in r["notes"]}),
    }


def _print_report(report: dict[str, Any]) -> None:
    machine = report.get("machine", {})
    name = machine.get("device_name", "?")
    print(
        f"bench_gpu: {name}, torch {machine.get('torch', '?')} (CUDA {machine.get('cuda')}), "
        f"{report['nproc']} gloo ranks sharing {report['device']}; load {report['load']}"
    )
    rates = machine.get("rates") or {}
    if rates:
        print(
            f"copy limits, one process, {machine['rate_bytes'] / 2**20:.0f} MiB (median of {report['reps']}):"
        )
        for what, r in rates.items():
            print(
                f"  {what:<26} "
                + (f"{r['ms']:9.3f} ms {r['GiB/s']:8.1f} GiB/s" if isinstance(r, dict) else r)
            )
    for case, c in report["cases"].items():
        print(
            f"case {case}: {report['nproc']} ranks x {c['bytes_per_rank'] / 2**20:.1f} MiB ({c['payload']}, "
            f"{c['tensors']} tensor(s) per rank), {c['received_bytes'] / 2**20:.1f} MiB received; "
            f"medians of {c['reps']} rounds"
        )
        print(
            f"  {'method':<16} {'all done ms':>12} {'p10':>10} {'p90':>10} {'rank 0 ms':>10} {'GiB/s recv':>11}"
        )
        for method in [m for m in METHODS if m in c["summary"]]:
            low, mid, high = c["summary"][method]["all done"]
            own = c["summary"][method]["rank 0"][1]
            rate = c["gib_per_s_received"][method]
            print(f"  {method:<16} {mid:12.3f} {low:10.3f} {high:10.3f} {own:10.3f} {rate:11.2f}")
        if c["ipc_copy_ms"] is not None:
            print(
                f"  ipc copy alone (rank 0, every sender's tensors, device to device): {c['ipc_copy_ms']:.3f} ms"
            )
        for note in c["notes"]:
            print(f"  note: {note}")
    for case, error in report["errors"].items():
        print(f"case {case} FAILED: {error}")
    print(f"ratios of median all done, on {name}:")
    for case, c in report["cases"].items():
        targets = {f"{a}/{b}": why for a, b, why in RATIOS if why}
        shown = [
            f"{k} {v:.2f}" + (f" ({targets[k]})" if k in targets else "") for k, v in c["ratios"].items()
        ]
        print(f"  {case}: " + "; ".join(shown))
        if "ipc_floor" in c["summary"]:
            ipc = c["summary"]["ipc_floor"]["all done"][1]
            auto = c["summary"]["ours_cuda"]["all done"][1]
            print(
                f"  {case}: ours_cuda (the IPC route) {auto:.3f} ms, ipc_floor {ipc:.3f} ms whole round "
                f"(target: ours <= {IPC_TARGET_MS:g} ms: {'met' if auto <= IPC_TARGET_MS else 'MISSED'})"
            )


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_CASES, choices=CASES, help="cases to run")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per method (default 5)")
    parser.add_argument("--nproc", type=int, default=4, help="local ranks (default 4)")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--device", default="cuda", help="cuda[:N] (default cuda:0), or cpu for a dry run")
    parser.add_argument("--layer-hidden", type=int, default=4096, help="the layer case's hidden size")
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error(f"--nproc must be at least 2 (a gather needs a sender); got {args.nproc}")
    if args.reps < 1:
        parser.error(f"--reps must be at least 1; got {args.reps}")
    if args.layer_hidden < 32 or args.layer_hidden % 32:
        parser.error(f"--layer-hidden must be a positive multiple of 32; got {args.layer_hidden}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device must be cuda, cuda:N or cpu; got {args.device!r}")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda, cuda:N or cpu; got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"bench_gpu.py: CUDA is not available here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}): run it on a machine with a GPU, or pass --device cpu for a dry run",
            file=sys.stderr,
        )
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    sizes = [SIZES[c] for c in args.sizes if c in SIZES]
    report: dict[str, Any] = {
        "device": str(device),
        "nproc": args.nproc,
        "reps": args.reps,
        "cases": {},
        "errors": {},
    }
    load_before = _load()
    prefix = f"{SEGMENT_PREFIX}{secrets.token_hex(4)}-"  # this run's /dev/shm files
    try:
        try:
            report["machine"] = run_local(
                _machine, 1, str(device), max(sizes, default=64 << 20), args.reps, prefix
            )[0]
        except LaunchError as exc:
            report["errors"]["copy limits"] = str(exc)
        for case in args.sizes:
            try:
                per_rank = run_local(
                    _case, args.nproc, case, args.reps, str(device), args.layer_hidden, prefix
                )
            except LaunchError as exc:
                report["errors"][case] = str(exc)
                continue
            report["cases"][case] = _case_report(per_rank, args.nproc)
    finally:
        _remove_segments(prefix)
    report["load"] = f"{load_before} before, {_load()} after (1/5/15 min)"
    _print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
