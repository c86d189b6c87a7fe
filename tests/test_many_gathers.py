"""Tens of thousands of gathers in one job: what each rank holds open stays bounded.

The first rank keeps its maps of its senders' pooled segments for their next payloads; docs/reliability.md
states the bound this checks: at most 2 per sender process (a sender's pool holds at most 2 segments),
each of a segment of at most 4 MiB, so at most 2 descriptors and 8 MiB per sender, however many
gathers. A sender holds at most 2 pooled segments (each open, and mapped once written again: 2
descriptors each).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from distribute_utils import get_configs_parallel, release_shared_memory

# Kept maps per sender process on the first rank, and pooled segments per sender (docs/reliability.md).
PER_SENDER = 2
# Tensor bytes of the large gathers, in turn (200 KiB travels attached to its claim, the others pooled).
LARGE = (300 * 2**10, 700 * 2**10, 3 * 2**20, 1536 * 2**10, 200 * 2**10)
SLACK_BYTES = 64 * 2**10  # a payload's header and config besides its tensor
SLACK_FDS = 2  # descriptors a rank may open once for good meanwhile (a socket)


def shm_held() -> tuple[int, int]:
    """``(descriptors open, bytes of the /dev/shm files this process holds open or mapped)``."""
    sizes: dict[int, int] = {}
    fds = os.listdir("/proc/self/fd")
    for fd in fds:
        path = f"/proc/self/fd/{fd}"
        try:
            if os.readlink(path).startswith("/dev/shm/"):
                info = os.stat(path)
                sizes[info.st_ino] = info.st_size
        except OSError:  # the listing's own descriptor, closed by now
            pass
    with open("/proc/self/maps") as maps:  # a map whose descriptor was closed holds pages too
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inode = int(fields[4])
                sizes[inode] = max(sizes.get(inode, 0), end - start)
    return len(fds), sum(sizes.values())


def _gather_one(i: int, large: int) -> None:
    """Gather ``{"i": i, "t": ...}`` from ranks [0, 1]: a tensor of ``large`` bytes, or of 4 floats."""
    tensor = torch.full((max(large // 4, 4),), float(i))
    with get_configs_parallel({"i": i, "t": tensor, "name": f"layer{i % 7}"}, [0, 1]) as got:
        if got:
            assert got[1]["i"] == i and float(got[1]["t"][-1]) == float(i), f"gather {i}"
    del got  # the views go: the segment may be written again, the map kept


def _many_gathers(n: int, every: int, sample_every: int) -> dict[str, Any]:
    """``n`` gathers: small configs, every ``every``-th with a large tensor (sizes in turn), and a burst of
    three large ones of growing sizes every 1,000th; ``shm_held()`` every ``sample_every`` gathers."""
    for i, large in enumerate(LARGE):  # warm up every path once (sockets, the pool)
        _gather_one(i, large)
        _gather_one(i, 0)
    release_shared_memory()
    _gather_one(0, 0)  # (tells the sender its segments are free, so it releases them now)
    release_shared_memory()
    dist.barrier()
    base = shm_held()
    samples = []
    for i in range(n):
        large = LARGE[(i // every) % len(LARGE)] if i % every == every - 1 else 0
        if i % 1000 in (500, 501, 502):
            large = LARGE[i % 1000 - 500 + 1]
        _gather_one(i, large)
        if i % sample_every == sample_every - 1:
            samples.append(shm_held())
    release_shared_memory()
    return {"base": base, "samples": samples}


def _check(results: list[dict[str, Any]], n: int) -> None:
    largest = max(LARGE) + SLACK_BYTES
    first, sender = results
    fds = [f for f, _ in first["samples"]]
    held = [b for _, b in first["samples"]]
    fd_bound = first["base"][0] + PER_SENDER + SLACK_FDS
    assert max(fds) <= fd_bound, f"rank 0's descriptors over {n} gathers: {fds} (bound {fd_bound})"
    assert max(held) <= PER_SENDER * largest, (
        f"rank 0 holds /dev/shm bytes over {n} gathers: {held} (bound {PER_SENDER * largest})"
    )
    fds = [f for f, _ in sender["samples"]]
    held = [b for _, b in sender["samples"]]
    fd_bound = sender["base"][0] + 2 * PER_SENDER + SLACK_FDS
    assert max(fds) <= fd_bound, f"the sender's descriptors over {n} gathers: {fds} (bound {fd_bound})"
    assert max(held) <= PER_SENDER * largest, f"the sender holds /dev/shm bytes: {held}"


def test_twenty_thousand_gathers_of_mixed_sizes_hold_a_bounded_number_of_descriptors_and_bytes(pools) -> None:
    """20,000 gathers on 2 ranks (about 380 through pooled segments, most of them new): rank 0's
    descriptors and the /dev/shm bytes it holds stay within the stated bound at every sample (before,
    they grew by one descriptor and one segment per pooled gather, up to 64 MiB)."""
    n = 20_000
    _check(pools.get(2).run(_many_gathers, n, 50, 500, timeout=600), n)
