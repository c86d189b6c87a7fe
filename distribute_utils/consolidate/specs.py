"""Internal. What a tensor is on disk, before its data exists: :class:`TensorSpec` (name, dtype, shape), the
safetensors names of torch dtypes, byte sizes (``"5GB"``) and a tensor's bytes as a buffer."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ArgumentError, CheckpointFormatError
from ..wire import tensor_buffer

__all__ = [
    "DTYPE_TO_SAFETENSORS",
    "SAFETENSORS_TO_DTYPE",
    "TensorSpec",
    "parse_size",
    "safetensors_dtype",
    "tensor_bytes",
]


def _build_dtype_map() -> dict[torch.dtype, str]:
    pairs: list[tuple[str, str]] = [
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("float8_e8m0fnu", "F8_E8M0"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint64", "U64"),
        ("uint32", "U32"),
        ("uint16", "U16"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("complex64", "C64"),
    ]
    return {getattr(torch, t): s for t, s in pairs if isinstance(getattr(torch, t, None), torch.dtype)}


#: torch dtype -> safetensors dtype string.
DTYPE_TO_SAFETENSORS: dict[torch.dtype, str] = _build_dtype_map()
#: safetensors dtype string -> torch dtype.
SAFETENSORS_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_SAFETENSORS.items()}


def safetensors_dtype(dtype: torch.dtype, name: str | None = None) -> str:
    """Returns the safetensors dtype string for a torch dtype.

    Raises:
        CheckpointFormatError: unsupported dtype; the message lists the supported ones.
    """
    try:
        return DTYPE_TO_SAFETENSORS[dtype]
    except KeyError:
        what = f"tensor '{name}' has dtype {dtype}" if name else f"dtype {dtype}"
        valid = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_TO_SAFETENSORS)
        raise CheckpointFormatError(f"{what}, which safetensors cannot store; supported: {valid}") from None


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: everything needed to plan a file before data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise CheckpointFormatError(
                f"tensor '{self.name}': negative dimension in shape {shape}; dimensions are ints >= 0"
            )
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of an existing tensor."""
        return cls(name, tensor.dtype, tuple(tensor.shape))


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str) -> int:
    """Parses a byte size: ``1000000``, ``"500MB"`` (10**6), ``"500MiB"`` (2**20), ``"1.5GB"``.

    Units (case-insensitive): B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024).

    Raises:
        ValueError: malformed, unknown unit, or not positive.
    """
    if isinstance(size, bool):
        raise ArgumentError(f"bad size {size!r}: expected an int or a string like '5GB', not a bool")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", size)
        if m is None:
            raise ArgumentError(
                f"bad size {size!r}: write a number with an optional unit, e.g. 5GB or 500MiB"
            )
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise ArgumentError(
                f"bad size {size!r}: unknown unit {m.group(2)!r}; valid units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        value = int(float(m.group(1)) * _UNITS[unit]) if "." in m.group(1) else int(m.group(1)) * _UNITS[unit]
    else:
        raise ArgumentError(f"bad size {size!r}: expected an int or a string like '5GB'")
    if value <= 0:
        raise ArgumentError(f"bad size {size!r}: must be positive")
    return value


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only view of a CPU tensor's bytes (copies only when not contiguous or not on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor_buffer(t.reshape(-1).view(torch.uint8))).cast("B")  # keeps a copy alive
