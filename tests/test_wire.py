"""Single-process tests of the wire format (``distribute_utils.wire``)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import gc
import math
import mmap
import os
import re
import struct
import sys
import tempfile
import tracemalloc
import warnings
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distribute_utils import wire
from distribute_utils.errors import PayloadError
from distribute_utils.wire import ALIGN, PREFIX_SIZE, decode, encode, read_prefix

from harness import relabel_devices

# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass
class Inner:
    act: Any
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    weight: Any
    inner: Inner | None = None


@dataclasses.dataclass(slots=True)
class Slotted:
    a: int
    b: Any = None


@dataclasses.dataclass
class Guarded:
    """Its __init__/__post_init__ must not run on decode."""

    value: int
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        raise AssertionError("__post_init__ must not run on decode")


class Color(enum.IntEnum):
    RED = 1


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as bytes in row-major order (works for dtypes without copy kernels)."""
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
    c = t.view(carrier[t.element_size()]) if t.dtype != carrier[t.element_size()] else t
    c = c.contiguous().reshape(-1).view(torch.uint8)
    return bytes(c.numpy().tobytes())


def same(a: Any, b: Any) -> bool:
    """Exact structural equality: same types, float bits, key order, tensor bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def roundtrip(obj: Any, **kw: Any) -> Any:
    return decode(bytearray(encode(obj, **kw).to_bytes()))


def craft(
    v: bytes, t: Any, data: bytes = b"", *, total: int | None = None, pad_to: int | None = None
) -> bytes:
    """A hand-made payload: raw msgpack ``v`` bytes, tensor table ``t`` and data after the header."""
    header = b"\x82\xa1v" + v + b"\xa1t" + msgpack.packb(t)
    body = header + bytes((pad_to - PREFIX_SIZE - len(header)) if pad_to else 0) + data
    n = PREFIX_SIZE + len(body) if total is None else total
    return struct.pack("<4sHHQQQ", b"DUW1", 1, 0, len(header), n, 0) + body


def patch_prefix(b: bytes, **fields: int) -> bytes:
    magic, version, flags, hl, total, ck = struct.unpack_from("<4sHHQQQ", b)
    vals = {"version": version, "flags": flags, "header_len": hl, "total": total, "checksum": ck}
    vals.update(fields)
    prefix = struct.pack(
        "<4sHHQQQ", magic, vals["version"], vals["flags"], vals["header_len"], vals["total"], vals["checksum"]
    )
    return prefix + b[PREFIX_SIZE:]


def all_torch_dtypes() -> list[torch.dtype]:
    """Every dtype attribute of the torch module that can make a CPU tensor."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            try:
                torch.empty(2, dtype=d)
            except Exception:
                continue
            out.append(d)
    return sorted(out, key=str)


QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
DTYPES = [d for d in all_torch_dtypes() if d not in QUANTIZED]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (max(n, 1),), dtype=torch.uint8, generator=g)[:n]
    return raw.view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)


# --------------------------------------------------------------------------- layout


def test_golden_bytes() -> None:
    got = encode({"a": 1, "w": torch.arange(3, dtype=torch.int16)}).to_bytes()
    expected = (
        # prefix: magic, version 2, flags 0, header_len 30, total_len 70, checksum 0
        b"DUW1"
        + b"\x02\x00"
        + b"\x00\x00"
        + (30).to_bytes(8, "little")
        + (70).to_bytes(8, "little")
        + bytes(8)
        # header: {"v": {"a": 1, "w": ext1(0)}, "t": [["int16", [3], 64, 6, "cpu"]]}
        + b"\x82\xa1v\x82\xa1a\x01\xa1w\xd4\x01\x00\xa1t\x91\x95\xa5int16\x91\x03\x40\x06\xa3cpu"
        + bytes(2)  # zero padding from byte 62 to the first tensor at 64
        + b"\x00\x00\x01\x00\x02\x00"  # int16 [0, 1, 2], little-endian
    )
    assert got == expected


def test_golden_bytes_of_version_1_still_decode() -> None:
    """A version 1 payload (entries without a device: every tensor was on the CPU) reads as before."""
    v1 = (
        b"DUW1\x01\x00\x00\x00"
        + (26).to_bytes(8, "little")
        + (70).to_bytes(8, "little")
        + bytes(8)
        + b"\x82\xa1v\x82\xa1a\x01\xa1w\xd4\x01\x00\xa1t\x91\x94\xa5int16\x91\x03\x40\x06"
        + bytes(6)
        + b"\x00\x00\x01\x00\x02\x00"
    )
    for device in (None, wire.SOURCE_DEVICE):
        got = decode(v1, device=device)
        assert got["a"] == 1 and got["w"].tolist() == [0, 1, 2] and got["w"].device.type == "cpu"
    with pytest.raises(PayloadError, match=r"is not \[dtype, shape, offset, nbytes\]"):
        decode(
            v1[:4] + b"\x01\x00" + encode({"a": 1, "w": torch.arange(3, dtype=torch.int16)}).to_bytes()[6:]
        )
    with pytest.raises(PayloadError, match=r"is not \[dtype, shape, offset, nbytes, device\]"):
        decode(v1[:4] + b"\x02\x00" + v1[6:])


def test_golden_ext_types() -> None:
    got = encode({"t": (1, "x"), "b": 2**64, "n": -(2**70)}).to_bytes()
    header = (
        b"\x82\xa1v\x83"
        + b"\xa1t\x93\xc7\x00\x02\x01\xa1x"  # tuple: array [ext 2 marker (no data), 1, "x"]
        + b"\xa1b\xc7\x09\x03"
        + bytes(8)
        + b"\x01"  # ext 3 (big int), 9 bytes two's complement LE
        + b"\xa1n\xc7\x09\x03"
        + bytes(8)
        + b"\xc0"
        + b"\xa1t\x90"
    )
    assert got[PREFIX_SIZE:] == header
    assert read_prefix(got) == (0, len(header), PREFIX_SIZE + len(header), 0)


def test_checksum_field_is_crc32_of_everything_after_prefix() -> None:
    p = encode(
        {"w": torch.arange(100, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float64)}, checksum=True
    )
    b = p.to_bytes()
    flags, _, total, ck = read_prefix(b)
    assert flags == wire.FLAG_CHECKSUM and total == len(b) == p.nbytes
    assert ck == zlib.crc32(b[PREFIX_SIZE:]) != 0


def test_layout_alignment_and_lengths() -> None:
    tensors = [
        torch.ones(5, dtype=torch.float32),
        torch.empty(0),
        torch.ones(7, dtype=torch.int8),
        torch.ones(()),
    ]
    p = encode(tensors)
    b = p.to_bytes()
    _, hl, total, _ = read_prefix(b)
    assert total == len(b) == p.nbytes
    entries = msgpack.unpackb(
        b[PREFIX_SIZE : PREFIX_SIZE + hl], strict_map_key=False, ext_hook=lambda c, d: 0
    )["t"]
    offsets = [e[2] for e in entries]
    assert all(o % ALIGN == 0 for o in offsets)
    assert offsets[0] == -(-(PREFIX_SIZE + hl) // ALIGN) * ALIGN  # first multiple of 64 after the header
    assert offsets == [offsets[0], offsets[0] + 64, offsets[0] + 64, offsets[0] + 128]
    assert total == offsets[-1] + 4  # ends with the last tensor
    assert len(p.head) == offsets[0]
    assert [o for o, _ in p.chunks] == [offsets[0], offsets[0] + 64, offsets[0] + 128]  # empty has no chunk


def test_no_tensors_total_is_end_of_header() -> None:
    p = encode({"x": 1})
    _, hl, total, _ = read_prefix(p.head)
    assert total == PREFIX_SIZE + hl == p.nbytes == len(p.head)
    assert p.chunks == ()


def test_only_empty_tensors() -> None:
    p = encode({"e": torch.empty(0, 3), "f": torch.empty(4, 0, dtype=torch.bfloat16)}, checksum=True)
    assert p.nbytes % ALIGN == 0 and p.chunks == () and len(p.head) == p.nbytes
    d = decode(p.to_bytes())
    assert d["e"].shape == (0, 3) and d["f"].dtype == torch.bfloat16 and d["f"].shape == (4, 0)


def test_read_prefix_needs_only_32_bytes() -> None:
    b = encode({"w": torch.ones(1000)}).to_bytes()
    pre = read_prefix(b[:PREFIX_SIZE])
    assert pre.total_len == len(b) and pre.flags == 0 and pre.checksum == 0
    assert isinstance(pre, tuple) and len(pre) == 4


# --------------------------------------------------------------------------- tensors


def test_dtype_whitelist_is_every_non_quantized_dtype() -> None:
    assert {wire.DTYPE_BY_NAME[n] for n in wire.SUPPORTED_DTYPES} == set(DTYPES)
    assert all(isinstance(d, torch.dtype) for d in wire.DTYPE_BY_NAME.values())
    for name in ("float8_e4m3fn", "float8_e5m2", "bfloat16", "complex128", "uint64", "bool", "int4"):
        if hasattr(torch, name):
            assert name in wire.SUPPORTED_DTYPES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_every_dtype(dtype: torch.dtype) -> None:
    base = random_tensor(dtype, (6, 10), seed=1)
    cases = {
        "plain": base,
        "scalar": random_tensor(dtype, (1,), seed=2).view(()),
        "empty": torch.empty((0, 4), dtype=dtype),
        "transposed": base.t(),
        "stepped": base[::2, 1::3],
        "row": base[3],
    }
    out = roundtrip(cases, checksum=True)
    for name, t in cases.items():
        got = out[name]
        assert got.dtype == dtype and got.shape == t.shape, name
        assert raw_bytes(got) == raw_bytes(t), name


def test_quantized_tensor_rejected() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match=r"config\['q'\]: tensor dtype torch.qint8 is not supported"):
        encode({"q": q})
    for dtype in sorted(set(all_torch_dtypes()) & QUANTIZED, key=str):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.empty(2, dtype=dtype)
        with pytest.raises(TypeError, match="quantized tensors carry scales"):
            encode([t])


def test_other_tensor_kinds_rejected() -> None:
    with pytest.raises(TypeError, match=r"config\[0\]: tensor layout torch.sparse_coo"):
        encode([torch.eye(3).to_sparse()])

    class MyTensor(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="tensor subclass"):
        encode([torch.ones(2).as_subclass(MyTensor)])


def test_view_of_large_base_stores_only_the_view() -> None:
    base = torch.randn(1000, 1000)  # 4 MB
    rows = base[10:12]  # contiguous 8 KB slice
    strided = base[::100, ::100]  # 100 elements, non-contiguous
    expanded = torch.ones(3).expand(1000, 3)  # stride-0 view: 3000 stored elements
    p = encode({"rows": rows, "strided": strided, "expanded": expanded})
    assert p.nbytes < 8000 + 400 + 12000 + 1024
    out = decode(p.to_bytes())
    assert torch.equal(out["rows"], rows) and torch.equal(out["strided"], strided)
    assert torch.equal(out["expanded"], expanded) and out["expanded"].is_contiguous()


def test_special_tensors() -> None:
    w = torch.nn.Parameter(torch.randn(3, 2))
    g = torch.randn(4, requires_grad=True) * 2
    z = torch.tensor([1 + 2j, 3 - 4j]).conj()  # lazy conj bit
    n = torch.tensor([1 + 2j]).conj().imag  # neg bit
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    out = roundtrip({"w": w, "g": g, "z": z, "n": n, "cl": cl})
    assert type(out["w"]) is torch.Tensor and torch.equal(out["w"], w.detach())
    assert not out["g"].requires_grad and torch.equal(out["g"], g.detach())
    assert torch.equal(out["z"], torch.tensor([1 - 2j, 3 + 4j]))
    assert torch.equal(out["n"], torch.tensor([-2.0]))
    assert torch.equal(out["cl"], cl)


def test_same_tensor_twice_is_stored_once() -> None:
    t = torch.randn(256)
    p = encode({"a": t, "b": [t]})
    assert len(p.chunks) == 1
    out = decode(p.to_bytes())
    assert out["a"] is out["b"][0]


def test_contiguous_cpu_tensor_is_not_copied_at_encode() -> None:
    t = torch.randn(64)
    p = encode([t])
    assert p.chunks[0][1].data_ptr() == t.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors() -> None:  # pragma: no cover - runs on GPU machines only
    base = torch.randn(64, 64, device="cuda")
    cases = {"v": base[::3, 1::2], "bf": base.to(torch.bfloat16), "f8": base.to(torch.float8_e4m3fn)}
    p = encode(cases)
    assert all(t.device.type == "cpu" for _, t in p.chunks)
    out = decode(p.to_bytes(), device="cuda")
    for k, t in cases.items():
        assert out[k].device.type == "cuda" and raw_bytes(out[k].cpu()) == raw_bytes(t.cpu())


# --------------------------------------------------------------------------- devices


def table_of(payload: bytes) -> list[list[Any]]:
    """The tensor table of a payload, read with msgpack alone."""
    _, hl, _, _ = read_prefix(payload)
    return msgpack.unpackb(
        payload[PREFIX_SIZE : PREFIX_SIZE + hl], strict_map_key=False, ext_hook=lambda c, d: 0
    )["t"]


def test_each_tensor_entry_names_its_sender_device() -> None:
    meta = torch.empty(3, 5, dtype=torch.bfloat16, device="meta")
    p = encode({"w": torch.ones(4), "m": meta, "e": torch.empty(0), "g": torch.empty(2, 2, device="meta")})
    b = p.to_bytes()
    table = table_of(b)
    assert [e[4] for e in table] == ["cpu", "meta", "cpu", "meta"]
    assert [e[3] for e in table] == [16, 0, 0, 0]  # a meta tensor has no bytes
    assert [o for o, _ in p.chunks] == [
        table[0][2]
    ]  # (the empty and meta ones end the payload at 64 further)
    assert p.nbytes == table[-1][2] == table[0][2] + ALIGN
    for device in (None, "cpu", wire.SOURCE_DEVICE):  # a meta tensor decodes as one, its dtype and shape kept
        out = decode(b, device=device)
        assert out["m"].is_meta and out["m"].dtype == torch.bfloat16 and out["m"].shape == (3, 5)
        assert out["g"].is_meta and out["g"].shape == (2, 2) and out["w"].tolist() == [1.0] * 4
    lone = encode(meta, root="tensor").to_bytes()
    assert table_of(lone) == [["bfloat16", [3, 5], table_of(lone)[0][2], 0, "meta"]]
    assert decode(lone).is_meta and decode(lone).shape == (3, 5)


def test_the_layout_kept_for_a_shape_is_kept_per_device() -> None:
    """Two payloads alike but for a tensor's device get their own headers (the encoder keeps layouts)."""
    on_cpu = encode({"w": torch.ones(2, 3)}).to_bytes()
    on_meta = encode({"w": torch.ones(2, 3, device="meta")}).to_bytes()
    assert table_of(on_cpu)[0][3:] == [24, "cpu"] and table_of(on_meta)[0][3:] == [0, "meta"]
    assert decode(on_cpu)["w"].tolist() == [[1.0] * 3] * 2 and decode(on_meta)["w"].is_meta


def test_source_device_keeps_cpu_tensors_as_views() -> None:
    p = encode({"a": torch.arange(5.0), "b": [torch.ones(3, dtype=torch.int8)], "c": torch.ones(2)})
    buf = bytearray(p.to_bytes())
    out = decode(buf, device=wire.SOURCE_DEVICE)
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert out["a"].data_ptr() == base + p.chunks[0][0] and out["b"][0].data_ptr() == base + p.chunks[1][0]
    assert out["a"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_config_without_tensors_decodes_alike_to_every_device_and_a_bad_one_raises() -> None:
    """A payload of plain values has nothing to place: every device gives the same tree, and a device that
    is not one raises as it does for a payload with tensors."""
    plain = {"a": 1, "b": [1.5, "x", None], "c": (True, b"\x00")}
    buf = wire.encode(plain).to_bytes()
    for device in (None, "cpu", torch.device("cpu"), wire.SOURCE_DEVICE):
        assert wire.decode(buf, device=device) == plain, device
    with_tensor = wire.encode({"t": torch.ones(2)}).to_bytes()
    for payload in (buf, with_tensor):
        with pytest.raises(RuntimeError, match="device"):
            wire.decode(payload, device="bogus")


def test_a_device_this_process_lacks_is_named_with_the_tensors_path() -> None:
    from distribute_utils.errors import DeviceUnavailableError

    config = {"layers": [{"w": torch.ones(2)}, Inner(act=torch.arange(3.0))], "s": (torch.zeros(1),)}
    payload = relabel_devices(encode(config).to_bytes(), {1: "cuda:7"})
    assert [e[4] for e in table_of(payload)] == ["cpu", "cuda:7", "cpu"]
    # Any other placement reads it: the bytes are all there (None / "cpu": views on the CPU).
    for device in (None, "cpu"):
        out = decode(payload, device=device)
        assert out["layers"][1].act.tolist() == [0.0, 1.0, 2.0] and out["s"][0].tolist() == [0.0]
    reason = "torch.cuda.is_available() is False" if not torch.cuda.is_available() else "device_count"
    with pytest.raises(DeviceUnavailableError, match=r"config\['layers'\]\[1\]\.act is on cuda:7") as err:
        decode(payload, device=wire.SOURCE_DEVICE)
    assert reason in str(err.value) and isinstance(err.value, RuntimeError)
    lone = relabel_devices(encode(torch.ones(2), root="tensor").to_bytes(), {0: "cuda:7"})
    with pytest.raises(DeviceUnavailableError, match=r"^tensor is on cuda:7 at its sender"):
        decode(lone, device=wire.SOURCE_DEVICE, root="tensor")
    # Raised with nothing of the payload held: the caller may close its mapping at once.
    with tempfile.TemporaryFile() as f:
        f.write(payload)
        f.flush()
        m = mmap.mmap(f.fileno(), len(payload))
        try:
            decode(m, device=wire.SOURCE_DEVICE)
        except DeviceUnavailableError:
            m.close()
        assert m.closed


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("nope", r"tensor 0: bad device 'nope'; expected a device as str\(tensor.device\) writes it"),
        ("cuda:07", r"bad device 'cuda:07'"),
        ("meta", r"tensor 0: nbytes 8 != 0: a meta tensor has no bytes"),
    ],
)
def test_bad_device_entries_are_refused(device: str, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(relabel_devices(encode([torch.ones(2)]).to_bytes(), {0: device}))


def test_unusable_device_says_why() -> None:
    assert wire.unusable_device("cpu") is None and wire.unusable_device("meta") is None
    assert wire.unusable_device(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert wire.unusable_device("cuda:0") == "torch.cuda.is_available() is False"
    assert wire.unusable_device(f"cuda:{torch.cuda.device_count() + 3}") is not None
    assert "device" in (wire.unusable_device("nope") or "").lower()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_restored_on_their_device() -> None:  # pragma: no cover - GPU machines only
    last = torch.cuda.device_count() - 1
    cases = {
        "a": torch.randn(8, 8, device="cuda:0")[::2],
        "b": torch.randn(5, device=f"cuda:{last}").to(torch.float8_e4m3fn),
        "c": torch.ones(3),
        "m": torch.empty(2, device="meta"),
    }
    b = encode(cases).to_bytes()
    assert [e[4] for e in table_of(b)] == ["cuda:0", f"cuda:{last}", "cpu", "meta"]
    out = decode(b, device=wire.SOURCE_DEVICE)
    assert [str(out[k].device) for k in "abcm"] == ["cuda:0", f"cuda:{last}", "cpu", "meta"]
    for k in "abc":
        assert raw_bytes(out[k].cpu()) == raw_bytes(cases[k].cpu())
    assert all(t.device.type == "cpu" for t in decode(b).values() if not t.is_meta)


# --------------------------------------------------------------------------- zero copy


def test_decode_is_zero_copy_and_keeps_buffer_alive() -> None:
    p = encode({"w": torch.zeros(16, dtype=torch.float32)})
    buf = bytearray(p.to_bytes())
    t = decode(buf)["w"]
    off = p.chunks[0][0]
    buf[off : off + 4] = struct.pack("<f", 2.5)
    assert t[0].item() == 2.5  # shares memory with the buffer
    del buf
    gc.collect()
    assert t[0].item() == 2.5 and t[1:].abs().sum().item() == 0  # still valid


def test_decode_from_mmap_pins_the_mapping() -> None:
    p = encode({"w": torch.arange(1000, dtype=torch.float64)})
    m = mmap.mmap(-1, p.nbytes + 100)  # page-rounded like a segment: trailing bytes are ignored
    p.write_into(m)
    t = decode(m)["w"]
    with pytest.raises(BufferError):
        m.close()  # cannot unmap under live tensors
    assert torch.equal(t, torch.arange(1000, dtype=torch.float64))
    del t
    gc.collect()
    m.close()


def test_failed_decode_does_not_pin_the_mapping() -> None:
    p = encode({"w": torch.arange(100, dtype=torch.float32), "c": (1, 2)}, checksum=True)
    for corrupt in (None, 0, 40, p.nbytes - 3):  # prefix error, header error, checksum error
        m = mmap.mmap(-1, p.nbytes)
        p.write_into(m)
        if corrupt is not None:
            m[corrupt] ^= 0xFF
        else:
            m[PREFIX_SIZE + 3] ^= 0xFF  # header byte: caught by the checksum
        try:
            decode(m)
        except PayloadError:
            m.close()  # must not raise BufferError: decode released its views
        else:
            pytest.fail("corruption not detected")
    m = mmap.mmap(-1, 16)
    try:
        read_prefix(m)
    except PayloadError:
        m.close()
    m = mmap.mmap(-1, 16)
    try:
        p.write_into(m)
    except ValueError:
        m.close()


def test_decode_accepts_buffer_kinds() -> None:
    p = encode({"w": torch.arange(10, dtype=torch.int32)})
    b = p.to_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only bytes must not warn
        for buf in (
            b,
            bytearray(b),
            memoryview(b),
            np.frombuffer(b, dtype=np.uint8),
            memoryview(b).cast("c"),
        ):
            assert torch.equal(decode(buf)["w"], torch.arange(10, dtype=torch.int32))
    with pytest.raises(TypeError, match="bytes-like"):
        decode("not bytes")


def test_decode_device_cpu_gives_views() -> None:
    p = encode([torch.ones(4)])
    buf = bytearray(p.to_bytes())
    t = decode(buf, device="cpu")[0]
    assert t.data_ptr() == np.frombuffer(buf, dtype=np.uint8).ctypes.data + p.chunks[0][0]


# --------------------------------------------------------------------------- writing


def test_write_into_and_to_bytes_agree() -> None:
    obj = {"a": torch.randn(33), "b": torch.arange(7, dtype=torch.int8), "c": "x" * 100}
    p = encode(obj, checksum=True)
    buf = bytearray(b"\xff" * (p.nbytes + 10))  # dirty buffer: padding must be written as zeros
    p.write_into(buf)
    assert bytes(buf[: p.nbytes]) == p.to_bytes()
    assert same(decode(buf), obj)
    with pytest.raises(ValueError, match="too small"):
        p.write_into(bytearray(p.nbytes - 1))
    with pytest.raises(TypeError, match="writable"):
        p.write_into(bytes(p.nbytes))


def test_write_into_copies_large_buffers_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor larger than the copy chunk arrives whole, each piece in its place."""
    monkeypatch.setattr(wire.payload, "COPY_CHUNK", 1000)
    obj = {"big": torch.arange(2501, dtype=torch.int16), "small": torch.arange(3, dtype=torch.int64)}
    p = encode(obj)
    buf = bytearray(b"\xff" * p.nbytes)
    p.write_into(buf)
    assert bytes(buf) == p.to_bytes()
    assert same(decode(buf), obj)


def test_write_to_fd(tmp_path: Any) -> None:
    obj = {f"t{i}": torch.randn(i * 5 + 1) for i in range(20)}
    p = encode(obj, checksum=True)
    path = tmp_path / "payload"
    path.write_bytes(b"\xee" * (p.nbytes + 200))  # dirty file
    fd = os.open(path, os.O_RDWR)
    try:
        p.write_to_fd(fd, base=100)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[100 : 100 + p.nbytes] == p.to_bytes()
    assert data[:100] == b"\xee" * 100 and data[100 + p.nbytes :] == b"\xee" * 100
    assert same(decode(data[100:]), obj)


def test_write_to_fd_splits_and_handles_short_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    obj = [torch.randn(300), torch.randn(5), "s" * 50, torch.randn(1000)]
    p = encode(obj)
    calls = []
    real = os.pwritev

    def short_pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append((len(bufs), sum(memoryview(b).nbytes for b in bufs)))
        return real(fd, [memoryview(bufs[0])[:13]], offset)  # at most 13 bytes per call

    monkeypatch.setattr(wire.payload, "MAX_WRITE", 100)
    monkeypatch.setattr(wire.payload, "IOV_MAX", 2)
    monkeypatch.setattr(os, "pwritev", short_pwritev)
    with tempfile.TemporaryFile() as f:
        p.write_to_fd(f.fileno())
        f.seek(0)
        assert f.read() == p.to_bytes()
    assert all(n <= 2 and size <= 100 for n, size in calls)
    assert len(calls) >= p.nbytes // 13


# --------------------------------------------------------------------------- configs


def test_every_supported_type_roundtrips() -> None:
    obj = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, 2**100, -(2**70), -(2**63) - 1, 10**400],
        "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308],
        "str": "héllo ✓ \x00",
        "bytes": b"\x00\xff raw",
        "nested": [(1, (2, [3, (4,)])), ()],
        "tuple_of_lists": ([], [[]]),
        3: "int key",
        -7: "negative int key",
        2**80: "big int key",
        "": "empty key",
        "tensor": torch.arange(4),
    }
    out = roundtrip(obj)
    assert same(out, obj)
    assert list(out) == list(obj)  # key order
    assert [type(k) for k in out] == [type(k) for k in obj]  # key types
    assert type(out["bools"][0]) is bool and type(out["nested"][0]) is tuple
    assert math.copysign(1.0, out["floats"][1]) == -1.0 and math.isnan(out["floats"][5])


def test_key_order_with_mixed_keys() -> None:
    obj = {"b": 1, 2: 2, "a": 3, 1: 4, 0: 5}
    out = roundtrip(obj)
    assert list(out.items()) == list(obj.items())


@pytest.mark.parametrize("top", [None, 1, "x", 2.5, True, [], {}, (), b""])
def test_top_level_scalars_and_empties(top: Any) -> None:
    assert same(roundtrip(top), top)


def test_dataclasses_roundtrip() -> None:
    obj = {
        "f": Frozen("q", torch.randn(3, 4), Inner(act=[torch.ones(2), (1, "gelu")], scale=0.25)),
        "s": Slotted(1, {"k": Inner("relu")}),
        "list": [Inner(None), Inner(2**90)],
    }
    out = roundtrip(obj, checksum=True)
    assert type(out["f"]) is Frozen and type(out["f"].inner) is Inner and type(out["s"]) is Slotted
    assert same(out, obj)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out["f"].name = "changed"


def test_dataclass_decode_runs_no_user_code() -> None:
    g = object.__new__(Guarded)
    object.__setattr__(g, "value", 5)
    object.__setattr__(g, "derived", 10)
    out = roundtrip(g)
    assert type(out) is Guarded and out.value == 5 and out.derived == 10


def make_dc(name: str, fields: list[tuple[str, Any]], module: str) -> type:
    cls = dataclasses.make_dataclass(name, fields)
    cls.__module__ = module
    return cls


def test_dataclass_from_unimportable_module() -> None:
    Ghost = make_dc("Ghost", [("x", int)], module="no_such_module_for_wire_tests")
    b = encode({"g": Ghost(1)}).to_bytes()
    with pytest.raises(
        PayloadError, match=r"no_such_module_for_wire_tests\.Ghost not found: module .* is not imported"
    ):
        decode(b)


def test_dataclass_missing_attribute_and_not_a_dataclass() -> None:
    Missing = make_dc("NoSuchClass", [("x", int)], module=__name__)
    with pytest.raises(PayloadError, match=r"NoSuchClass not found: module .* has no 'NoSuchClass'"):
        decode(encode(Missing(1)).to_bytes())
    Fake = make_dc("OrderedDict", [("x", int)], module="collections")
    with pytest.raises(PayloadError, match=r"collections\.OrderedDict is a type, expected a dataclass type"):
        decode(encode(Fake(1)).to_bytes())


def test_dataclass_field_mismatch() -> None:
    Other = make_dc("Inner", [("act", Any), ("extra", int)], module=__name__)
    with pytest.raises(
        PayloadError, match=r"Inner: the payload has fields \['act', 'extra'\] but the class has"
    ):
        decode(encode(Other(1, 2)).to_bytes())


def test_decoding_never_imports_a_module_a_payload_names(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted module on the path must not run: payloads name classes, never import them."""
    ran = tmp_path / "ran"
    mod = tmp_path / "wire_test_dc_mod.py"
    mod.write_text(
        f"open({str(ran)!r}, 'w').close()\n"
        "import dataclasses, enum\n@dataclasses.dataclass\nclass P:\n    x: int\n"
        "class E(enum.Enum):\n    A = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import wire_test_dc_mod  # type: ignore[import-not-found]

    payloads = [encode(wire_test_dc_mod.P(7)).to_bytes(), encode(wire_test_dc_mod.E.A).to_bytes()]
    assert type(decode(payloads[0])).__name__ == "P" and decode(payloads[1]).name == "A"  # imported: fine
    monkeypatch.delitem(sys.modules, "wire_test_dc_mod")
    ran.unlink()
    for b, what in zip(payloads, ("dataclass", "enum")):
        with pytest.raises(
            PayloadError, match=rf"{what} wire_test_dc_mod\.[PE] not found: module .* is not imported"
        ):
            decode(b)
    assert not ran.exists(), "the planted module's code ran"
    with pytest.raises(PayloadError, match="not imported"):  # the standard library too: no Zen of Python
        decode(encode(make_dc("T", [("x", int)], module="this")(1)).to_bytes())


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = 2


def test_types_modelopt_configs_carry_round_trip_exactly() -> None:
    """numpy scalars and arrays, enum members and OrderedDict, as torch.save / JSON carry them."""
    tree = {
        "f64": np.float64(0.1),
        "i64": np.int64(-(2**40)),
        "f32": np.float32(1.5),
        "flag": np.bool_(True),
        "arr": np.arange(12, dtype=np.float32).reshape(3, 4),
        "iarr": np.array([[1, -2]], dtype=np.int64),
        "color": Color.RED,
        "mode": [Mode.FAST, Mode.SLOW],
        "od": collections.OrderedDict([("b", 1), ("a", np.float16(2.0))]),
    }
    out = decode(bytearray(encode(tree).to_bytes()))
    for key in ("f64", "i64", "f32", "flag"):
        assert type(out[key]) is type(tree[key]) and out[key] == tree[key], key
    assert (
        type(out["arr"]) is np.ndarray
        and out["arr"].dtype == np.float32
        and (out["arr"] == tree["arr"]).all()
    )
    assert out["iarr"].shape == (1, 2) and out["iarr"].dtype == np.int64 and out["iarr"].tolist() == [[1, -2]]
    assert out["color"] is Color.RED and out["mode"] == [Mode.FAST, Mode.SLOW]
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["b", "a"]
    assert type(out["od"]["a"]) is np.float16


def test_crafted_typed_values_are_refused() -> None:
    good = encode({"c": Color.RED}).to_bytes()
    planted = good.replace(b"test_wire", b"test_wirX") if b"test_wire" in good else None
    if planted is not None:
        with pytest.raises(PayloadError, match="not imported"):
            decode(planted)
    not_enum = encode(make_dc("OrderedDict", [("x", int)], module="collections")(1)).to_bytes()
    with pytest.raises(PayloadError, match="expected a dataclass type"):
        decode(not_enum)


# --------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            {"layers": [0, 1, 2, {"act_fn": lambda x: x}]},
            "config['layers'][3]['act_fn']: cannot encode a value of type function",
        ),
        ([object()], "config[0]: cannot encode a value of type object"),
        (
            {"s": {1, 2}},
            "config['s']: cannot encode a value of type set; supported: None, bool, int, float, str",
        ),
        ({"n": np.array(["a"])}, "config['n']: cannot encode a value of type numpy.ndarray"),
        ({"n": np.str_("a")}, "config['n']: cannot encode a value of type numpy.str_"),
        ({"b": bytearray(b"x")}, "config['b']: cannot encode a value of type bytearray"),
        ({"p": collections.namedtuple("P", "x")(1)}, "config['p']: cannot encode a value of type"),
        ({1.5: 2}, "config: dict key 1.5 of type float is not supported; keys must be str or int"),
        ({"d": {(1, 2): 3}}, "config['d']: dict key (1, 2) of type tuple is not supported"),
        ({"d": {True: 3}}, "config['d']: dict key True of type bool is not supported"),
        ({"t": (1, [2, {"x": ...}])}, "config['t'][1][1]['x']: cannot encode a value of type ellipsis"),
    ],
)
def test_type_errors_name_the_path(obj: Any, message: str) -> None:
    with pytest.raises(TypeError) as info:
        encode(obj)
    assert str(info.value).startswith(message.replace("test_wire.", f"{__name__}.")), str(info.value)
    if "dict key" not in message:
        assert "torch.Tensor" in str(info.value)  # lists what is supported


def test_type_error_path_through_dataclass_fields_and_root() -> None:
    cfg = Frozen("m", None, Inner(act=[1, {"fn": open}]))
    with pytest.raises(
        TypeError, match=r"^model\.inner\.act\[1\]\['fn'\]: cannot encode a value of type builtin_function"
    ):
        encode(cfg, root="model")


def test_open_file_and_int_subclass_hint() -> None:
    with open(__file__) as f, pytest.raises(TypeError, match=r"config\['f'\]: .*TextIOWrapper"):
        encode({"f": f})

    class Small(int):
        pass

    with pytest.raises(TypeError, match=r"convert with int\(value\)"):
        encode([Small(1)])


def test_lone_surrogate_str_rejected() -> None:
    with pytest.raises(TypeError, match="not valid UTF-8"):
        encode({"s": "\ud800"})


def test_local_dataclass_rejected_at_encode() -> None:
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(TypeError, match=r"config\['l'\]: dataclass .*Local is defined inside a function"):
        encode({"l": Local(1)})


def test_cycles_are_detected() -> None:
    a: list[Any] = [1]
    a.append(a)
    with pytest.raises(
        TypeError, match=r"^config\[1\]: reference cycle: this list is the object at config, "
    ):
        encode(a)
    d: dict[str, Any] = {"x": {}}
    d["x"]["y"] = [d]
    with pytest.raises(
        TypeError, match=r"^cfg\['x'\]\['y'\]\[0\]: reference cycle: this dict is the object at cfg,"
    ):
        encode(d, root="cfg")
    inner = Inner(act=None)
    inner.act = {"back": inner}
    with pytest.raises(
        TypeError, match=r"^config\.act\['back'\]: reference cycle: this test_wire.Inner|Inner"
    ):
        encode(inner)


def test_shared_references_are_not_cycles() -> None:
    shared = [1, 2]
    out = roundtrip({"a": shared, "b": shared, "c": (shared, shared)})
    assert out["a"] == out["b"] == [1, 2] and out["c"] == ([1, 2], [1, 2])


def test_too_deep_nesting() -> None:
    obj: Any = 1
    for _ in range(wire.MAX_DEPTH + 1):
        obj = [obj]
    with pytest.raises(TypeError, match=f"nested deeper than {wire.MAX_DEPTH}"):
        encode(obj)
    obj = 1
    for _ in range(wire.MAX_DEPTH - 1):
        obj = (obj,)
    assert roundtrip(obj) == obj


NESTS: dict[str, Any] = {
    "dict": lambda v: {"k": v},
    "list": lambda v: [v],
    "tuple": lambda v: (v,),
    "dataclass": lambda v: Inner(v, 0.5),
    "odict": lambda v: collections.OrderedDict(k=v),
}


@pytest.mark.parametrize("kind", [*NESTS, "mixed"])
def test_too_deep_nesting_of_every_kind_is_a_clear_type_error(kind: str) -> None:
    """10,000 containers of any kind the encoder walks: the TypeError names the level and the limit (no
    RecursionError, whatever the kind); exactly MAX_DEPTH of them travel."""
    makers = list(NESTS.values())

    def nest(levels: int) -> Any:
        value: Any = torch.ones(1)
        for i in range(levels):
            value = (makers[i % len(makers)] if kind == "mixed" else NESTS[kind])(value)
        return value

    with pytest.raises(TypeError) as info:
        encode(nest(10_000))
    message = str(info.value)
    assert f"containers nested deeper than {wire.MAX_DEPTH} levels" in message
    assert f"is at level {wire.MAX_DEPTH + 1}, past the limit of {wire.MAX_DEPTH} (wire.MAX_DEPTH)" in message
    assert message.startswith("config") and "...(190 more)..." in message and len(message) < 500, message
    deepest = nest(wire.MAX_DEPTH)
    out = decode(encode(deepest).to_bytes())
    for _ in range(wire.MAX_DEPTH):  # the same containers, level by level
        assert type(out) is type(deepest)
        out, deepest = _only_child(out), _only_child(deepest)
    assert torch.equal(out, deepest)


def _only_child(value: Any) -> Any:
    if isinstance(value, dict):
        return value["k"]
    if isinstance(value, (list, tuple)):
        return value[0]
    return value.act


def test_nesting_error_names_a_cycle_or_the_level() -> None:
    """What code that walks a config without encoding it (the first rank's own value) raises."""
    loop: dict[str, Any] = {}
    loop["a"] = [loop]
    error = wire.nesting_error("config", [("a",), 0, ("a",)], [loop, loop["a"], loop])
    assert str(error).startswith("config['a'][0]: reference cycle: this dict is the object at config,")
    chain = [[] for _ in range(wire.MAX_DEPTH + 1)]  # distinct containers: no cycle
    deep = wire.nesting_error("config", [0] * wire.MAX_DEPTH, chain)
    assert str(deep).startswith("config[0][0][0][0][0]...(190 more)...[0][0][0][0][0]: containers nested")
    assert f"this list is at level {wire.MAX_DEPTH + 1}, past the limit of {wire.MAX_DEPTH}" in str(deep)


# --------------------------------------------------------------------------- corruption


SAMPLE = {
    "w": torch.arange(40, dtype=torch.float32).view(5, 8),
    "cfg": {"a": (1, 2), 3: "x"},
    "b": torch.ones(3),
}


def sample_bytes(checksum: bool = True) -> bytes:
    return encode(SAMPLE, checksum=checksum).to_bytes()


def test_truncation() -> None:
    b = sample_bytes()
    with pytest.raises(PayloadError, match=f"truncated: payload says {len(b)} bytes, got {len(b) - 1}"):
        decode(b[:-1])
    with pytest.raises(PayloadError, match="truncated: payload prefix needs 32 bytes, got 10"):
        decode(b[:10])
    with pytest.raises(PayloadError, match="truncated: payload prefix needs 32 bytes, got 0"):
        decode(b"")


def test_flipped_byte_with_checksum() -> None:
    b = bytearray(sample_bytes())
    b[-5] ^= 0x01  # inside the last tensor
    with pytest.raises(
        PayloadError, match=r"checksum mismatch: prefix says 0x[0-9a-f]{8}, bytes 32\.\.\d+ give"
    ):
        decode(b)
    assert decode(b, verify=False)["b"][1].item() != 1.0  # verify=False skips the check


def test_partial_write_is_caught_by_checksum() -> None:
    p = encode(SAMPLE, checksum=True)
    buf = bytearray(p.nbytes)
    buf[: len(p.head)] = p.head  # the writer died after the head
    with pytest.raises(PayloadError, match="checksum mismatch"):
        decode(buf)


def test_prefix_errors() -> None:
    b = sample_bytes(checksum=False)
    with pytest.raises(PayloadError, match=r"bad magic b'XUW1': expected b'DUW1'"):
        decode(b"X" + b[1:])
    with pytest.raises(
        PayloadError, match="unsupported wire format version 3: this reader supports versions 1, 2"
    ):
        decode(patch_prefix(b, version=3))
    with pytest.raises(PayloadError, match="unknown flags 0x0004"):
        decode(patch_prefix(b, flags=4))
    with pytest.raises(PayloadError, match="checksum flag is not set: expected 0"):
        decode(patch_prefix(b, checksum=5))
    with pytest.raises(PayloadError, match="is not a CRC-32 value"):
        decode(patch_prefix(b, flags=1, checksum=2**40))
    with pytest.raises(
        PayloadError, match=r"header length 1099511627776 exceeds the limit of 67108864 bytes"
    ):
        decode(patch_prefix(b, header_len=2**40))
    with pytest.raises(PayloadError, match="header length 3 is too small"):
        decode(patch_prefix(b, header_len=3))
    with pytest.raises(PayloadError, match=r"total length 100 is smaller than prefix \+ header"):
        decode(patch_prefix(b, header_len=90, total=100))
    with pytest.raises(PayloadError, match="exceeds the limit of 10 bytes"):
        decode(b, max_header_bytes=10)
    with pytest.raises(PayloadError, match=f"payload says {len(b) + 64} bytes"):
        decode(patch_prefix(b, total=len(b) + 64))


def test_header_length_mismatch() -> None:
    b = sample_bytes(checksum=False)
    hl = read_prefix(b).header_len
    with pytest.raises(PayloadError, match="msgpack data ends before the"):
        decode(patch_prefix(b, header_len=hl - 1))
    with pytest.raises(PayloadError, match=f"msgpack map ends at byte {hl} of a {hl + 2}-byte header"):
        decode(patch_prefix(b, header_len=hl + 2))


V0 = b"\xd4\x01\x00"  # ext 1: tensor 0
DATA = bytes(range(16))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            craft(V0, [["float32", [4], 128, 16]], DATA + bytes(16), pad_to=128),
            "payload length 160 does not match the end of its content at byte 144",
        ),
        (
            craft(V0, [["float32", [4], 0, 16]], DATA, pad_to=64),
            "offset 0 overlaps the header, which ends at byte 54",
        ),
        (craft(V0, [["float32", [4], 100, 16]], DATA, pad_to=100), "offset 100 is not a multiple of 64"),
        (
            craft(V0, [["float32", [4], 64, 16]], DATA[:8], pad_to=64),
            "bytes 64..80 run past the payload's end at 72",
        ),
        (craft(V0, [["float32", [4], 64, 12]], DATA, pad_to=64), r"nbytes 12 != 4 elements x 4 bytes"),
        (craft(V0, [["float32", [-4], 64, 16]], DATA, pad_to=64), r"bad shape \[-4\]"),
        (craft(V0, [["float32", [2**64 - 1, 0], 64, 0]], pad_to=64), "bad shape"),
        (craft(V0, [["float32", [1] * 65, 192, 4]], DATA[:4], pad_to=192), "bad shape"),
        (
            craft(V0, [["float128", [4], 64, 16]], DATA, pad_to=64),
            "tensor 0: unknown dtype 'float128'; expected one of",
        ),
        (craft(V0, [["qint8", [4], 64, 4]], DATA, pad_to=64), "unknown dtype 'qint8'"),
        (craft(V0, [["__class__", [4], 64, 4]], DATA, pad_to=64), "unknown dtype '__class__'"),
        (craft(V0, [[7, [4], 64, 4]], DATA, pad_to=64), "unknown dtype 7"),
        (craft(V0, [["float32", [4], 64]], DATA, pad_to=64), r"is not \[dtype, shape, offset, nbytes\]"),
        (craft(V0, [["uint8", [4], "64", 4]], DATA, pad_to=64), "must be ints"),
        (craft(V0, {"x": 1}), '"t" is a dict, expected a list'),
        (craft(V0, []), "tensor reference 0 out of range: the payload has 0 tensors"),
        (
            craft(
                b"\xd4\x01\x05",
                [["uint8", [4], 128, 4], ["uint8", [4], 192, 4]],
                b"abcd" + bytes(60) + b"efgh",
                pad_to=128,
            ),
            "tensor reference 5 out of range: the payload has 2 tensors",
        ),
        (
            craft(
                b"\x92" + V0 + b"\xd4\x01\x01",
                [["uint8", [8], 128, 8], ["uint8", [4], 128, 4]],
                DATA[:8],
                pad_to=128,
            ),
            r"tensors 0 and 1 overlap|tensors 1 and 0 overlap",
        ),
        (craft(b"\xd4\x09\x00", []), r"unknown ext type 9: expected 1 \(tensor\), 2 \(tuple\)"),
        (craft(b"\xd6\xff\x00\x00\x00\x01", []), "unknown ext type -1 .msgpack timestamp."),
        (craft(b"\x91\xd6\xff\x00\x00\x00\x01", []), "unknown ext type -1"),
        (craft(b"\x81\xa1k\xd6\xff\x00\x00\x00\x01", []), "unknown ext type -1"),
        (craft(b"\xc0", [], bytes(10)), "payload length 49 does not match the end of its content at byte 39"),
        (craft(b"\xc7\x00\x03", []), "empty big-int ext data"),
        (
            craft(b"\x81\xcb" + struct.pack(">d", 1.5) + b"\x01", []),
            "dict key 1.5 of type float: expected str or int keys",
        ),
        (craft(b"\x81\xc4\x01k\x01", []), "dict key b'k' of type bytes"),
        (craft(b"\xc1", []), "malformed header"),
        (craft(b"\xa2\xff\xfe", []), "malformed header: UnicodeDecodeError"),
        (craft(b"\xd4\x02\x01", []), "ext type 2 marker carries 1 data bytes, expected none"),
        (craft(b"\xc7\x00\x02", []), "misplaced tuple marker"),
        (craft(b"\x92\x01\xc7\x00\x02", []), "misplaced tuple marker"),
        (craft(b"\x81\xa1k\xc7\x00\x04", []), "misplaced dataclass marker"),
        (craft(b"\x92\xc7\x00\x02\xc7\x00\x04", []), "misplaced dataclass marker"),
        (craft(b"\x91\xd4\x01\x00", []), "tensor reference 0 out of range"),
        (
            craft(b"\x92\xc7\x00\x04\x01", []),
            r"dataclass marker followed by \[1\], expected module, qualname",
        ),
        (
            craft(msgpack.packb([msgpack.ExtType(4, b""), "os", "system()", {}]), []),
            "not a valid module path",
        ),
        (craft(msgpack.packb([msgpack.ExtType(4, b""), "..x", "y", {}]), []), "not a valid module path"),
        (
            craft(msgpack.packb([msgpack.ExtType(4, b""), "os", "sep", {}]), []),
            "os.sep is a str, expected a dataclass",
        ),
    ],
)
def test_crafted_payloads(payload: bytes, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(payload)


def test_crafted_header_structure() -> None:
    def raw(header: bytes) -> bytes:
        return struct.pack("<4sHHQQQ", b"DUW1", 1, 0, len(header), PREFIX_SIZE + len(header), 0) + header

    with pytest.raises(PayloadError, match=r'unexpected or repeated key .v.; expected "v" and "t"'):
        decode(raw(b"\x82\xa1v\xc0\xa1v\xc0"))
    with pytest.raises(PayloadError, match=r'a map with 3 entries, expected 2 \("v" and "t"\)'):
        decode(raw(b"\x83\xa1v\xc0\xa1t\x90\xa1x\xc0"))
    with pytest.raises(PayloadError, match="unexpected or repeated key 'x'"):
        decode(raw(b"\x82\xa1x\xc0\xa1t\x90"))
    with pytest.raises(PayloadError, match="malformed header"):
        decode(raw(b"\x93\xa1v\xc0\xa1t\x90"))  # an array, not a map
    assert decode(raw(b"\x82\xa1t\x90\xa1v\xa1k")) == "k"  # key order inside the header map is free
    # A size bomb: a 2**31-element array announced in a 16-byte header must not allocate.
    with pytest.raises(PayloadError, match="malformed header"):
        decode(raw(b"\x82\xa1v\xc0\xa1t\xdd\x7f\xff\xff\xff" + bytes(6)))
    with pytest.raises(PayloadError, match="malformed header"):
        decode(raw(b"\x82\xa1v\xdf\x7f\xff\xff\xff\xa1t\x90" + bytes(6)))


def test_deep_nesting_is_refused_without_crashing() -> None:
    for opener in (b"\x91", b"\x92\xc7\x00\x02"):  # 1-element arrays / 1-tuples
        v = opener * 5000 + b"\xc0" + (b"\xc0" if opener != b"\x91" else b"")
        header = b"\x82\xa1v" + v + b"\xa1t\x90"
        payload = struct.pack("<4sHHQQQ", b"DUW1", 1, 0, len(header), PREFIX_SIZE + len(header), 0) + header
        with pytest.raises(PayloadError, match="malformed header"):
            decode(payload)


def _raw(header: bytes, data: bytes = b"") -> bytes:
    """A payload of a hand-made header (any bytes) and the bytes after it, its lengths stated right."""
    return struct.pack("<4sHHQQQ", b"DUW1", 1, 0, len(header), PREFIX_SIZE + len(header) + len(data), 0) + (
        header + data
    )


def _nested_array(levels: int) -> bytes:
    return b"\x91" * levels + b"\xc0"  # [[[...[None]...]]]


@pytest.mark.parametrize("levels", [950, 1000, 1023, 1024, 1025, 5000])
def test_crafted_deep_headers_are_refused_clearly(levels: int) -> None:
    """Arrays nested near and past the interpreter's recursion limit (1000) and msgpack's (1024), wherever
    a crafted header can put them: a PayloadError saying what is wrong, never a RecursionError (raw, or
    wrapped in a message)."""
    deep = _nested_array(levels)
    ext_data = len(deep).to_bytes(4, "big")
    cases = {
        "header key": (b"\x82" + deep + b"\xc0\xa1t\x90", r"unexpected or repeated key \(a msgpack list\)"),
        "table entry": (b"\x82\xa1v\xc0\xa1t\x91" + deep, r"tensor 0: entry \[\[\[\[...\]\]\]\] is not"),
        "dict key": (
            b"\x82\xa1v\x81" + deep + b"\xc0\xa1t\x90",
            r"dict key \[\[\[\[...\]\]\]\] of type list",
        ),
        "dataclass": (b"\x82\xa1v\x92\xc7\x00\x04" + deep + b"\xa1t\x90", "dataclass marker followed by"),
        "typed": (b"\x82\xa1v\x92\xc7\x00\x05" + deep + b"\xa1t\x90", "typed-value marker followed by"),
        "tensor ref": (b"\x82\xa1v\xc9" + ext_data + b"\x01" + deep + b"\xa1t\x90", r"tensor reference \[\["),
    }
    too_deep = f"nested deeper than msgpack's limit of 1024 levels (encode writes at most {wire.MAX_DEPTH}"
    for name, (header, message) in cases.items():
        with pytest.raises(PayloadError) as info:
            decode(_raw(header))
        text = str(info.value)
        assert "RecursionError" not in text, (name, text)
        # (the arrays around it count too: near 1024 levels either message is right)
        assert re.search(message, text) or (levels > 1000 and too_deep in text), (name, text)
    tree = _raw(b"\x82\xa1v" + deep + b"\xa1t\x90")  # a deep config tree: within msgpack's limit, decoded
    if levels <= 1024:
        out = decode(tree)
        for _ in range(levels):
            (out,) = out
        assert out is None
    else:
        with pytest.raises(PayloadError, match=re.escape(too_deep)):
            decode(tree)


def _crafted_table(empty: int, full: int, apart: int, data: int) -> bytes:
    """A payload whose table holds ``empty`` empty tensors, then ``apart`` 64-byte tensors side by side and
    ``full`` more at the first data offset (each overlapping the first), then ``data`` bytes of data."""
    start = ALIGN
    while True:  # offsets are absolute: find where the data starts once the table holds them
        table = [["bool", [0], start, 0]] * empty + [
            ["uint8", [64], start + 64 * i, 64] for i in range(apart)
        ]
        table += [["uint8", [64], start, 64]] * full
        header = b"\x82\xa1v\xc0\xa1t" + msgpack.packb(table)
        data_start = -(-(PREFIX_SIZE + len(header)) // ALIGN) * ALIGN
        if data_start == start:
            break
        start = data_start
    return _raw(header, bytes(start - PREFIX_SIZE - len(header) + data))


def _decode_peak(payload: bytes) -> tuple[int, str]:
    """Peak bytes of Python objects that decoding ``payload`` allocated (tracemalloc), and its error."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(PayloadError) as info:
            decode(payload)
        return tracemalloc.get_traced_memory()[1] - base, str(info.value)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("empty", "full", "apart", "refusal"),
    [
        (25_000, 0, 0, "empty tensors in a payload of"),  # the reported case, at 3 sizes
        (50_000, 0, 0, "empty tensors in a payload of"),
        (100_000, 0, 0, "empty tensors in a payload of"),
        (0, 50_000, 25_000, "tensors 0 and 25000 overlap"),  # more non-empty tensors than fit apart
        (50_000, 1, 25_000, "overlap|empty tensors"),  # both kinds, each within its bound but the last
    ],
)
def test_crafted_table_costs_a_small_multiple_of_its_size(
    empty: int, full: int, apart: int, refusal: str
) -> None:
    """A crafted tensor table is refused while it is read: decoding holds at most TABLE_BYTES_PER_BYTE
    bytes of Python objects per payload byte (+ TABLE_BYTES_CONSTANT), where reading the whole table
    before checking it cost ~20 per byte."""
    decode(encode({"w": torch.ones(2)}).to_bytes())  # (whatever decoding loads once is loaded)
    payload = _crafted_table(empty, full, apart, 64 * apart)
    peak, message = _decode_peak(payload)
    assert re.search(refusal, message), message
    bound = wire.TABLE_BYTES_PER_BYTE * len(payload) + wire.TABLE_BYTES_CONSTANT
    assert peak <= bound, f"{peak / len(payload):.1f} bytes per payload byte ({peak:,} for {len(payload):,})"


def test_long_tables_read_entry_by_entry() -> None:
    """Tables longer than what is unpacked in one call: exact, in any order, and refused clearly."""
    tensors = {f"t{i}": torch.full((i % 7,), float(i)) for i in range(3000)}
    payload = encode(tensors).to_bytes()
    assert read_prefix(payload).header_len > 40_000  # a long table
    out = decode(payload)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())
    # 64-byte tensors side by side, their entries in reverse order (tensor i is entry n-1-i): disjoint
    side_by_side = _crafted_table(0, 0, 1200, 64 * 1200)
    hl = read_prefix(side_by_side).header_len
    assert hl > 16384  # (a table read entry by entry)
    head = msgpack.unpackb(side_by_side[PREFIX_SIZE : PREFIX_SIZE + hl])
    head["t"].reverse()
    header = msgpack.packb(head)
    assert len(header) == hl
    assert decode(side_by_side[:PREFIX_SIZE] + header + side_by_side[PREFIX_SIZE + hl :]) is None
    table = head["t"]
    table[0][1] = [[[] for _ in range(60)] for _ in range(30)]  # 1,800 empty arrays in one entry
    with pytest.raises(PayloadError, match=r"tensor 0: its entry takes \d+ bytes, more than any valid"):
        decode(_raw(b"\x82\xa1v\xc0\xa1t" + msgpack.packb(table)))
    table[0][1] = [1] * 66
    with pytest.raises(PayloadError, match="tensor 0: ValueError: 66 exceeds max_array_len"):
        decode(_raw(b"\x82\xa1v\xc0\xa1t" + msgpack.packb(table)))
    table[0][1] = {"a": 1}
    with pytest.raises(PayloadError, match=r"tensor 0: bad shape \{'a': 1\}"):
        decode(_raw(b"\x82\xa1v\xc0\xa1t" + msgpack.packb(table)))
    with pytest.raises(PayloadError, match=r'"t" is a dict, expected a list'):
        decode(_raw(b"\x82\xa1v\xc0\xa1t" + msgpack.packb({"x": "y" * 20_000})))


# --------------------------------------------------------------------------- properties

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10)
    | st.binary(max_size=10)
)
_keys = st.text(max_size=6) | st.integers(min_value=-(2**70), max_value=2**70)
_trees = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(_keys, children, max_size=4)
        | st.builds(Inner, children, st.floats(allow_nan=False))
    ),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=_trees, checksum=st.booleans())
def test_property_random_configs_roundtrip(tree: Any, checksum: bool) -> None:
    p = encode({"tree": tree, "t": torch.arange(3)}, checksum=checksum)
    b = p.to_bytes()
    assert len(b) == p.nbytes == read_prefix(b).total_len
    out = decode(b)
    assert same(out["tree"], tree)


CORRUPT_BASE = encode(
    {"w": torch.randn(7, 3), "e": torch.empty(0), "c": {"k": (1, 2**70, "s")}, "d": Inner(torch.ones(2))},
    checksum=True,
).to_bytes()


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, len(CORRUPT_BASE) - 1), xor=st.integers(1, 255))
def test_property_single_byte_corruption_always_detected(pos: int, xor: int) -> None:
    b = bytearray(CORRUPT_BASE)
    b[pos] ^= xor
    with pytest.raises(PayloadError):
        decode(b)


@settings(max_examples=300, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(CORRUPT_BASE) - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    cut=st.none() | st.integers(0, len(CORRUPT_BASE)),
    checksum=st.booleans(),
)
def test_property_corruption_raises_only_payload_error(
    edits: list[tuple[int, int]], cut: int | None, checksum: bool
) -> None:
    base = CORRUPT_BASE if checksum else sample_bytes(checksum=False)
    b = bytearray(base)
    for pos, value in edits:
        b[pos % len(b)] = value
    if cut is not None:
        del b[cut:]
    with contextlib.suppress(PayloadError):  # anything else fails the test
        decode(b)


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, len(CORRUPT_BASE) - 1))
def test_property_truncation_always_detected(cut: int) -> None:
    with pytest.raises(PayloadError):
        decode(CORRUPT_BASE[:cut])


def test_decode_from_a_separate_data_tensor_builds_views_of_it() -> None:
    # The path device buffers take (NCCL receives): header read from host bytes, tensors as
    # views of the data tensor. Exercised here with a CPU tensor standing in for the device.
    tree = {
        "w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(),
        "b": torch.tensor([True, False]),
        "e": torch.zeros(0, 2),
        "c": torch.tensor([1 + 2j], dtype=torch.complex64),
    }
    payload = wire.encode(tree)
    data = torch.frombuffer(bytearray(payload.to_bytes()), dtype=torch.uint8)
    head = bytes(payload.head)
    out = wire.decode_split(head, data)
    for key, value in tree.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape
        assert torch.equal(
            out[key].reshape(-1).view(torch.uint8), value.contiguous().reshape(-1).view(torch.uint8)
        )
    assert out["w"].untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    with pytest.raises(PayloadError, match="truncated"):
        wire.decode_split(head, data[:-1])
    with pytest.raises(TypeError, match="decode_split takes a flat, contiguous uint8 tensor"):
        wire.decode_split(head, data.view(torch.int8))
    summed = wire.encode(tree, checksum=True)
    summed_data = torch.frombuffer(bytearray(summed.to_bytes()), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="cannot carry a checksum"):
        wire.decode_split(bytes(summed.head), summed_data)


def test_decode_accepts_a_cpu_uint8_tensor_zero_copy() -> None:
    payload = wire.encode({"x": torch.arange(5)})
    buf = torch.frombuffer(bytearray(payload.to_bytes()), dtype=torch.uint8)
    out = wire.decode(buf)
    buf[payload.chunks[0][0]] = 9
    assert int(out["x"][0]) == 9
    with pytest.raises(TypeError, match="flat, contiguous uint8"):
        wire.decode(buf.view(torch.int8))


def test_keep_device_and_to_cpu() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    payload = wire.encode({"t": t.t()}, keep_device=True)
    assert not payload.device_resident  # CPU tensors are not device-resident
    assert payload.to_cpu() is payload
    with pytest.raises(ValueError, match="checksum"):
        wire.encode({"t": t}, checksum=True, keep_device=True)


def test_decoding_work_is_bounded_by_the_payload_size() -> None:
    """Empty tensors cost a reader memory but no payload bytes: a flood of them is refused."""
    many = encode([torch.empty(0)] * 1).to_bytes()  # one is fine
    assert decode(bytearray(many))[0].numel() == 0
    flood = encode([torch.empty(0) for _ in range(20_000)]).to_bytes()
    with pytest.raises(PayloadError, match="empty tensors in a payload of"):
        decode(bytearray(flood))
    fine = [torch.empty(0) for _ in range(4000)]  # a real config's worth passes
    assert len(decode(bytearray(encode(fine).to_bytes()))) == 4000


def test_the_header_limit_is_checked_when_encoding() -> None:
    """One limit, before anything is written: a sender learns it, not the reader after a write."""
    with pytest.raises(ValueError, match="over the limit of 67,108,864 that every reader applies"):
        encode({"s": "x" * (64 * 2**20 + 1)})


def test_a_known_head_still_has_its_length_checksum_and_limit_checked() -> None:
    """A payload whose head (prefix and header) was checked before skips those checks, and only those:
    a truncated copy, a corrupted checksummed one and a header over a smaller limit are refused as the
    first time."""
    payload = encode({"w": torch.arange(64, dtype=torch.float32)}, root="config").to_bytes()
    assert torch.equal(decode(bytearray(payload))["w"], torch.arange(64, dtype=torch.float32))
    assert wire.head_known(payload)
    with pytest.raises(PayloadError, match="truncated: payload says"):
        decode(bytearray(payload[:-4]))
    header_len = wire.read_prefix(payload).header_len
    with pytest.raises(PayloadError, match=f"header length {header_len} exceeds the limit"):
        decode(bytearray(payload), max_header_bytes=header_len - 1)

    summed = encode(torch.arange(64, dtype=torch.float32), root="tensor", checksum=True).to_bytes()
    assert torch.equal(decode(bytearray(summed)), torch.arange(64, dtype=torch.float32))
    corrupt = bytearray(summed)
    corrupt[-1] ^= 0xFF
    with pytest.raises(PayloadError, match="checksum mismatch"):
        decode(corrupt)
