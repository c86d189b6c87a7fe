"""What every case of ``scripts/bench_gather.py`` shares: settings, rows, the rank context, data and timing helpers."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

MIB = 2**20
SHM_DIR = "/dev/shm"
MADV_POPULATE_READ = 22  # Linux >= 5.14; not in Python's mmap module before 3.13
LAYER_TENSORS = 64
_LAYER_SHAPES: tuple[tuple[int, ...], ...] = ((4096,), (128, 128), (), (128,))
_LAYER_DTYPES = (torch.float32, torch.float32, torch.float32, torch.bfloat16)

# Where the 64 layer tensors go in a ModelOpt DecoderLayerConfig: 7 linears x 7 tensor fields,
# 5 layernorms x 2, the KV-cache scales and biases, and one gate tensor.
_MO_LINEARS = (
    "attention.qkv.q",
    "attention.qkv.k",
    "attention.qkv.v",
    "attention.dense",
    "mlp.fc",
    "mlp.gate",
    "mlp.proj",
)
_MO_LINEAR_FIELDS = (
    "weight",
    "bias",
    "activation_scaling_factor",
    "weights_scaling_factor",
    "weights_scaling_factor_2",
    "prequant_scaling_factor",
    "per_channel_scale",
)
_MO_LAYERNORMS = (
    "input_layernorm",
    "post_layernorm",
    "mlp_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
_MO_SLOTS: tuple[str, ...] = (
    *(f"{linear}.{name}" for linear in _MO_LINEARS for name in _MO_LINEAR_FIELDS),
    *(f"{norm}.{name}" for norm in _MO_LAYERNORMS for name in ("weight", "bias")),
    "attention.k_cache_bias",
    "attention.v_cache_bias",
    "attention.k_cache_scaling_factor",
    "attention.v_cache_scaling_factor",
    "gate_ffwd",
)
assert len(_MO_SLOTS) == LAYER_TENSORS

TARGETS = {
    "bulk_vs_modelopt": 6.0,
    "bulk_vs_dist_gather": 4.0,
    "layer_vs_modelopt": 3.0,
    "small_max_ms": 3.0,
    "memory_max_ratio": 1.2,
    "workspace_vs_save_load": 0.8,
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures; the same object reaches every rank."""

    nproc: int
    repeats: int
    warmup: int
    bulk_bytes: int
    layers: int
    small_rounds: int
    modelopt: bool
    quick: bool
    timeout_s: float
    groups: tuple[str, ...] = ("shm",)  # "shm": cases 1-4; "workspace": case 5
    workspace_dir: str | None = None  # local-disk workspace of case 5 (made by the parent)
    workspace_layers: int = 16  # layers in a row in the workspace layer-config cases
    workspace_repeats: int = 5  # timed repetitions per workspace method (each moves 3 x 64 MiB)
    multinode: tuple[str, ...] = ()  # simulated-node workspaces of case 5: "dir", "sshfs"


@dataclasses.dataclass
class Row:
    """One timed method of one case (times are rank 0's, in seconds)."""

    case: str
    key: str
    method: str
    times_s: list[float]
    compare_to: str | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """The row with its times in ms; ``median_ms`` is None when the method failed (see note)."""
        times_ms = [t * 1e3 for t in self.times_s]
        return {
            "case": self.case,
            "key": self.key,
            "method": self.method,
            "compare_to": self.compare_to,
            "note": self.note,
            "n": len(times_ms),
            "median_ms": statistics.median(times_ms) if times_ms else None,
            "min_ms": min(times_ms, default=None),
            "max_ms": max(times_ms, default=None),
            "times_ms": times_ms,
        }


@dataclasses.dataclass
class RankContext:
    """What every rank's measurement code needs."""

    rank: int
    world: int
    settings: Settings
    mo_distribute: Any | None = None  # modelopt.torch.export.distribute, when importable
    mo_config: Any | None = None  # modelopt.torch.export.model_config
    rows: list[Row] = dataclasses.field(default_factory=list)
    report: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world))

    @property
    def first(self) -> bool:
        return self.rank == 0

    def add(self, row: Row) -> None:
        if self.first:
            self.rows.append(row)


# ---------------------------------------------------------------------------------- helpers


def measure(fn: Callable[[], None], repeats: int, warmup: int) -> list[float]:
    """Run ``fn`` on every rank, a gloo barrier before each run; this rank's times after warm-up.

    Must be called on every rank. Each time runs from the end of the barrier to the end of
    ``fn`` on this rank.
    """
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return times


def touch(tensors: Sequence[torch.Tensor]) -> float:
    """Read one element (the last) of every tensor, so that results are really there."""
    return sum(float(t.reshape(-1)[-1]) for t in tensors if t.numel())


def read_all(tensors: Sequence[torch.Tensor]) -> int:
    """Read every byte of every 4-byte tensor (a max over its bits: no temporary tensor)."""
    return sum(int(t.view(torch.int32).max()) for t in tensors if t.numel())


def bulk_tensor(rank: int, nbytes: int) -> torch.Tensor:
    """Rank ``rank``'s bulk tensor: random float32 bit patterns (NaNs and all), reproducible."""
    gen = torch.Generator().manual_seed(1000 + rank)
    bits = torch.randint(-(2**31), 2**31, (nbytes // 4,), dtype=torch.int32, generator=gen)
    return bits.view(torch.float32)


def layer_config(rank: int, layer: int, n_tensors: int = LAYER_TENSORS) -> dict[str, Any]:
    """Rank ``rank``'s config of decoder layer ``layer``: ``n_tensors`` small tensors, scalar entries."""
    gen = torch.Generator().manual_seed(rank * 100_003 + layer)
    config: dict[str, Any] = {
        "name": f"layers.{layer}",
        "decoder_type": "llama",
        "hidden_act": "silu",
        "quantization": "fp8",
        "num_attention_heads": 32,
        "num_kv_heads": 8,
        "tp_rank": rank,
        "rotary_base": 10000.0,
        "eps": 1e-5,
    }
    for j in range(n_tensors):
        shape, dtype = _LAYER_SHAPES[j % 4], _LAYER_DTYPES[j % 4]
        config[f"tensor_{j:02d}"] = torch.randn(shape, generator=gen).to(dtype)
    return config


def layer_tensors(config: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a :func:`layer_config`, in order."""
    return [value for key, value in config.items() if key.startswith("tensor_")]


def modelopt_layer(config: dict[str, Any], mc: Any) -> Any:
    """The same tensors and scalars inside ModelOpt's ``DecoderLayerConfig`` (first slots first)."""
    layer = mc.DecoderLayerConfig(
        decoder_type=config["decoder_type"],
        num_attention_heads=config["num_attention_heads"],
        num_kv_heads=config["num_kv_heads"],
        rotary_base=int(config["rotary_base"]),
    )
    layer.attention = mc.AttentionConfig(
        qkv=mc.QKVConfig(q=mc.LinearConfig(), k=mc.LinearConfig(), v=mc.LinearConfig()),
        dense=mc.LinearConfig(),
    )
    layer.mlp = mc.MLPConfig(
        fc=mc.LinearConfig(), gate=mc.LinearConfig(), proj=mc.LinearConfig(), hidden_act="silu"
    )
    for norm in _MO_LAYERNORMS:
        setattr(layer, norm, mc.LayernormConfig(eps=config["eps"]))
    for slot, tensor in zip(_MO_SLOTS, layer_tensors(config)):
        *parents, name = slot.split(".")
        setattr(functools.reduce(getattr, parents, layer), name, tensor)
    return layer


def modelopt_touch(layers: Sequence[Any], n_tensors: int) -> float:
    """Touch the first and last tensor of each ModelOpt-shaped layer."""
    last = _MO_SLOTS[n_tensors - 1].split(".")
    return touch(
        [
            t
            for layer in layers
            for t in (layer.attention.qkv.q.weight, functools.reduce(getattr, last, layer))
        ]
    )


def dict_touch(configs: Sequence[dict[str, Any]], n_tensors: int) -> float:
    """Touch the first and last tensor of each dict-shaped layer."""
    last = f"tensor_{n_tensors - 1:02d}"
    return touch([t for config in configs for t in (config["tensor_00"], config[last])])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def proc_status() -> dict[str, int]:
    """This process's memory counters from ``/proc/self/status``, in bytes."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    found: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                found[key] = int(value.split()[0]) * 1024
    return found


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False when refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def exact_malloc_accounting() -> Any | None:
    """Make glibc map every allocation of 1 MiB or more and unmap it on free; return libc.

    glibc's adaptive threshold otherwise serves 8-32 MiB buffers from a heap whose freed pages
    stay resident, so a later buffer reuses them and the RSS does not grow by its size. Called
    only before the memory case, after every timed case. None where this is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3
        if not libc.mallopt(m_mmap_threshold, 1 * MIB):
            return None
    except (OSError, AttributeError):
        return None
    return libc


def import_modelopt() -> tuple[Any, Any] | str:
    """ModelOpt's ``distribute`` and ``model_config`` modules, or why they cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from modelopt.torch.export import distribute, model_config
    except Exception as exc:  # any import-time failure means "not available here"
        return f"{type(exc).__name__}: {exc}"
    return distribute, model_config


def median_ms(times: Sequence[float]) -> float:
    """Median of ``times`` (seconds), in milliseconds."""
    return statistics.median(times) * 1e3


def loads_text(values: Sequence[float] | None) -> str:
    """Load averages as ``1.0/0.8/0.5``, or ``-``."""
    return "/".join(f"{v:.1f}" for v in values) if values else "-"


def cost_row(step: str, times: list[float], nbytes: int) -> dict[str, Any]:
    """One step of a one-process cost table: median and best time, and the rate at the best."""
    best = min(times)
    return {
        "step": step,
        "median_ms": median_ms(times),
        "min_ms": best * 1e3,
        "gib_per_s_at_min": nbytes / 2**30 / best,
    }
