"""Micro benchmark of the wire format: encode, write, decode, checksum.

Usage::

    python scripts/bench_wire.py [--mib 64] [--repeat 5]

Prints one table of medians: big-payload throughput (encode, ``write_to_fd`` into a fresh
and into an already-touched ``/dev/shm`` file, ``write_into`` an mmap, ``to_bytes``, decode
with and without checksum verification), the per-call latency of a small per-layer config,
and the checksum candidates over the same bytes (the reason ``wire`` uses ``zlib.crc32``).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import mmap
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable

import torch

from distribute_utils.wire import decode, encode


def median_s(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(name: str, seconds: float, nbytes: int | None = None) -> None:
    rate = f"{nbytes / seconds / 1e9:8.2f}" if nbytes else " " * 8
    shown = f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} us"
    print(f"| {name:<44} | {shown:>11} | {rate} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="tensor bytes of the big payload (MiB)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (median shown)")
    args = parser.parse_args(argv)
    n = args.mib * 2**20
    big = {
        "w": torch.randn(n // 4 // 2),
        "bf": torch.randn(n // 2 // 2).to(torch.bfloat16),
        "cfg": {"quant": "fp8", "group": 128},
    }
    small = {
        "weight_scale": torch.rand(4096),
        "input_scale": torch.rand(()),
        "awq_pre_quant_scale": torch.rand(4096, dtype=torch.float16),
        "config": {"quantization": "int4_awq", "group_size": 128, "tp": (0, 8), "axis": 0},
    }
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    print(f"| {'operation':<44} | {'median':>11} | {'GB/s':>8} |")
    print(f"|{'-' * 46}|{'-' * 13}|{'-' * 10}|")
    p = encode(big)
    row(f"encode {args.mib} MiB (contiguous: no copy)", median_s(lambda: encode(big), args.repeat), None)
    row("encode, checksum=True (CRC-32 pass)", median_s(lambda: encode(big, checksum=True), args.repeat), n)
    pc = encode(big, checksum=True)

    fd, path = tempfile.mkstemp(dir=shm_dir, prefix="bench_wire_")
    try:

        def fresh() -> None:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, p.nbytes)

        row("write_to_fd, fresh tmpfs pages", median_s(lambda: p.write_to_fd(fd), args.repeat, fresh), n)
        row("write_to_fd, pages already touched", median_s(lambda: p.write_to_fd(fd), args.repeat), n)
        m = mmap.mmap(fd, p.nbytes)
        row("write_into mmap (touched pages)", median_s(lambda: p.write_into(m), args.repeat), n)
        row("to_bytes", median_s(p.to_bytes, args.repeat), n)
        pc.write_to_fd(fd)
        row("decode from mmap, no verification", median_s(lambda: decode(m, verify=False), args.repeat), None)
        row("decode from mmap, verify CRC-32", median_s(lambda: decode(m), args.repeat), n)
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)

    sb = encode(small, checksum=True).to_bytes()
    reps = 2000
    row(
        f"small layer config: encode ({len(sb)} B)",
        median_s(lambda: [encode(small) for _ in range(reps)], 3) / reps,
    )
    row("small layer config: decode", median_s(lambda: [decode(sb) for _ in range(reps)], 3) / reps)

    data = memoryview(pc.to_bytes())[32:]
    for name, fn in [
        ("zlib.crc32 (chosen)", lambda: zlib.crc32(data)),
        ("zlib.adler32", lambda: zlib.adler32(data)),
        ("hashlib.blake2b(digest_size=8)", lambda: hashlib.blake2b(data, digest_size=8).digest()),
        ("hashlib.sha1", lambda: hashlib.sha1(data).digest()),
    ]:
        row(f"checksum: {name}", median_s(fn, args.repeat), data.nbytes)

    t = torch.randn(1024).to(torch.bfloat16)

    def via_numpy() -> None:
        for _ in range(reps):
            memoryview(t.reshape(-1).view(torch.uint8).numpy())

    def via_ctypes() -> None:
        for _ in range(reps):
            memoryview((ctypes.c_ubyte * 2048).from_address(t.data_ptr())).cast("B")

    row("tensor -> memoryview: view(uint8).numpy()", median_s(via_numpy, 3) / reps)
    row("tensor -> memoryview: ctypes (chosen)", median_s(via_ctypes, 3) / reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
