"""Cases 1-4 of ``scripts/bench_gather.py`` (bulk, layer config, small round trip, memory) and the write-cost steps of one process."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distribute_utils import barrier as store_barrier
from distribute_utils import get_configs_parallel, get_tensors_parallel, wire
from distribute_utils.transports import carriers
from distribute_utils.transports.base import Context
from distribute_utils.transports.local_disk import LocalDiskCarrier, local_dir
from distribute_utils.transports.shm import SharedMemoryTransport
from gatherbench.common import (
    MADV_POPULATE_READ,
    MIB,
    SHM_DIR,
    RankContext,
    Row,
    bulk_tensor,
    cost_row,
    dict_touch,
    exact_malloc_accounting,
    layer_config,
    measure,
    modelopt_layer,
    modelopt_touch,
    proc_status,
    read_all,
    reset_peak_rss,
    same_bits,
    touch,
)

# ---------------------------------------------------------------------------------- cases


def bench_bulk(ctx: RankContext) -> None:
    """Case 1: one large float32 tensor per rank to rank 0."""
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    tensor = bulk_tensor(rank, s.bulk_bytes)
    case = f"bulk {ctx.world}x{s.bulk_bytes // MIB}MiB"

    # Correctness of ours, once, bit for bit.
    with get_tensors_parallel(tensor, ranks, transport="shm") as got:
        if ctx.first:
            exact = len(got) == ctx.world and all(
                same_bits(got[r], bulk_tensor(r, s.bulk_bytes)) for r in range(1, ctx.world)
            )
            ctx.report["verified_bulk_bit_exact"] = exact
            if not exact:
                raise AssertionError("ours returned different bytes than the ranks sent (bulk)")
            del got[:]

    def ours(consume: Callable[[Sequence[torch.Tensor]], object]) -> Callable[[], None]:
        def run() -> None:
            with get_tensors_parallel(tensor, ranks, transport="shm") as got:
                if got:
                    consume(got)

        return run

    outputs = [torch.empty_like(tensor) for _ in ranks] if ctx.first else None
    if outputs is not None:
        for out in outputs:
            out.zero_()  # fault the pages in once: "preallocated"

    def gather(consume: Callable[[Sequence[torch.Tensor]], object]) -> Callable[[], None]:
        def run() -> None:
            dist.gather(tensor, outputs, dst=0)
            if outputs is not None:
                consume(outputs)

        return run

    def gather_fresh() -> None:
        fresh = [torch.empty_like(tensor) for _ in ranks] if ctx.first else None
        dist.gather(tensor, fresh, dst=0)
        if fresh is not None:
            touch(fresh)

    def gather_object() -> None:
        objects: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(tensor, objects, dst=0)
        if objects is not None:
            touch(objects)

    reps, warm = s.repeats, s.warmup
    ctx.add(Row(case, "ours", "ours get_tensors_parallel (shm)", measure(ours(touch), reps, warm)))
    ctx.add(
        Row(case, "gather", "dist.gather (gloo, preallocated)", measure(gather(touch), reps, warm), "ours")
    )
    ctx.add(
        Row(
            case,
            "gather_fresh",
            "dist.gather (gloo, outputs allocated per call)",
            measure(gather_fresh, reps, warm),
            "ours",
        )
    )
    ctx.add(Row(case, "gather_object", "dist.gather_object", measure(gather_object, reps, warm), "ours"))
    if ctx.mo_distribute is not None:
        mo = ctx.mo_distribute

        def modelopt() -> None:
            with mo.get_tensors_parallel(tensor, ranks, None) as got:
                if got:
                    touch(got)

        ctx.add(Row(case, "modelopt", "ModelOpt get_tensors_parallel", measure(modelopt, reps, warm), "ours"))
    ctx.add(Row(case, "ours_read", "ours + read every byte", measure(ours(read_all), reps, warm)))
    ctx.add(
        Row(
            case,
            "gather_read",
            "dist.gather + read every byte",
            measure(gather(read_all), reps, warm),
            "ours_read",
        )
    )


def bench_layers(ctx: RankContext, n_tensors: int) -> None:
    """Case 2: ``layers`` decoder-layer configs in a row, ``n_tensors`` tensors each; time per layer."""
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    configs = [layer_config(rank, i, n_tensors) for i in range(s.layers)]
    case = f"layer config ({n_tensors} tensors), per layer"

    with get_configs_parallel(configs[0], ranks, None, transport="shm") as got:
        if ctx.first:
            exact = len(got) == ctx.world
            for r in range(1, ctx.world):
                want = layer_config(r, 0, n_tensors)
                exact = exact and list(got[r]) == list(want)
                for key, value in want.items():
                    mine = got[r][key]
                    ok = same_bits(mine, value) if isinstance(value, torch.Tensor) else mine == value
                    exact = exact and ok
            ctx.report[f"verified_layer_{n_tensors}_bit_exact"] = exact
            if not exact:
                raise AssertionError(f"ours returned a different config than the ranks sent ({case})")

    def per_layer(fn: Callable[[], None]) -> list[float]:
        return [t / s.layers for t in measure(fn, s.repeats, s.warmup)]

    def ours() -> None:
        for config in configs:
            with get_configs_parallel(config, ranks, None, transport="shm") as got:
                if got:
                    dict_touch(got, n_tensors)

    def gather_object() -> None:
        for config in configs:
            objects: list[Any] | None = [None] * ctx.world if ctx.first else None
            dist.gather_object(config, objects, dst=0)
            if objects is not None:
                dict_touch(objects, n_tensors)

    ctx.add(Row(case, "ours", "ours get_configs_parallel (dict)", per_layer(ours)))
    ctx.add(Row(case, "gather_object", "dist.gather_object (dict)", per_layer(gather_object), "ours"))
    if ctx.mo_distribute is None:
        return
    mo, mc = ctx.mo_distribute, ctx.mo_config
    mo_layers = [modelopt_layer(config, mc) for config in configs]

    def ours_dataclass() -> None:
        for layer in mo_layers:
            with get_configs_parallel(layer, ranks, None, transport="shm") as got:
                if got:
                    modelopt_touch(got, n_tensors)

    ctx.add(
        Row(
            case,
            "ours_dc",
            "ours get_configs_parallel (DecoderLayerConfig)",
            per_layer(ours_dataclass),
            note="the very objects ModelOpt gets",
        )
    )

    def modelopt() -> None:
        for layer in mo_layers:
            with mo.get_configs_parallel(layer, ranks, None) as got:
                if got:
                    modelopt_touch(got, n_tensors)

    label = "ModelOpt get_configs_parallel (DecoderLayerConfig)"
    error = modelopt_attempt(ctx, lambda: modelopt_config_round(mo, mo_layers[0], ranks))
    if error is None:
        ctx.add(Row(case, "modelopt", label, per_layer(modelopt), "ours_dc"))
    else:
        ctx.add(Row(case, "modelopt", label, [], "ours_dc", note=f"fails: {error}"))


def modelopt_config_round(mo: Any, config: Any, ranks: list[int]) -> None:
    """One ModelOpt ``get_configs_parallel`` round, recovering the ranks when rank 0's read fails.

    ModelOpt sizes its segment by estimate (2 KiB per tensor); ``torch.load`` looks for the zip
    directory in the last 64 KiB and fails on a config of more than ~36 tensors ("failed finding
    central directory"). The failure is raised on rank 0 inside ModelOpt's ``__enter__``, while
    the senders already wait in its closing barrier: rank 0 joins that barrier, so the senders
    unlink their segments, and re-raises.
    """
    try:
        with mo.get_configs_parallel(config, ranks, None):
            pass
    except Exception:
        if dist.get_rank() == ranks[0]:
            dist.barrier()
        raise


def modelopt_attempt(ctx: RankContext, attempt: Callable[[], None]) -> str | None:
    """Run ``attempt`` on every rank; the first error any rank saw (agreed everywhere), or None."""
    error = None
    try:
        attempt()
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0].split('. ')[0][:160]}"
    errors: list[str | None] = [None] * ctx.world
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def bench_small(ctx: RankContext) -> None:
    """Case 3: a tiny config, many rounds, each timed barrier to barrier."""
    s, ranks = ctx.settings, ctx.ranks
    case = "small round trip"
    small = {"a": 1}
    rounds, warm = s.small_rounds, max(5, s.warmup)

    def ours() -> None:
        with get_configs_parallel(small, ranks, None, transport="shm") as got:
            if got and got[-1] != small:
                raise AssertionError(f"ours returned {got[-1]!r} for {small!r}")

    def gather_object() -> None:
        objects: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(small, objects, dst=0)

    ctx.add(Row(case, "ours", 'ours get_configs_parallel {"a": 1}', measure(ours, rounds, warm)))
    ctx.add(Row(case, "gather_object", "dist.gather_object", measure(gather_object, rounds, warm), "ours"))
    if ctx.mo_distribute is not None:
        # ModelOpt sizes the segment of a config without tensors with no room for the torch.save
        # of its (empty) weights and fails ("data out of range"): give it one 1-element tensor.
        mo, tiny = ctx.mo_distribute, ctx.mo_config.LayernormConfig(weight=torch.ones(1), eps=1e-5)

        def modelopt() -> None:
            with mo.get_configs_parallel(tiny, ranks, None) as got:
                if got:
                    _ = got[-1].eps

        ctx.add(
            Row(
                case,
                "modelopt",
                "ModelOpt get_configs_parallel",
                measure(modelopt, rounds, warm),
                "ours",
                note="LayernormConfig with a 1-element weight: it carries ModelConfig types only",
            )
        )
    ctx.add(Row(case, "gloo_barrier", "reference: dist.barrier (gloo)", measure(dist.barrier, rounds, warm)))
    ctx.add(
        Row(
            case,
            "store_barrier",
            "reference: distribute_utils.barrier (store)",
            measure(store_barrier, rounds, warm),
        )
    )


def bench_memory(ctx: RankContext) -> None:
    """Case 4: rank 0's peak RSS growth during one bulk gather, per received byte."""
    s, rank, ranks = ctx.settings, ctx.rank, ctx.ranks
    tensor = bulk_tensor(rank, s.bulk_bytes)
    received = (ctx.world - 1) * s.bulk_bytes
    results: list[dict[str, Any]] = []
    libc = exact_malloc_accounting()

    def one(key: str, method: str, run: Callable[[Callable[..., None]], None]) -> None:
        held: dict[str, int] = {}

        def consume(tensors: Sequence[torch.Tensor], *, everything: bool = True) -> None:
            if everything:
                read_all(tensors)
            else:
                touch(tensors)
            held.update(proc_status())

        gc.collect()
        if libc is not None:
            libc.malloc_trim(0)
        dist.barrier()
        base = proc_status()
        exact = reset_peak_rss() if ctx.first else False
        run(consume)
        after = proc_status()
        dist.barrier()
        if not ctx.first:
            return
        peak = (after["VmHWM"] if exact else max(held.get("VmRSS", 0), after["VmRSS"])) - base["VmRSS"]
        results.append(
            {
                "key": key,
                "method": method,
                "received_bytes": received,
                "peak_growth_bytes": peak,
                "ratio": peak / received,
                "peak_exact": exact,
                "held_anon_bytes": held.get("RssAnon", 0) - base["RssAnon"],
                "held_shmem_bytes": held.get("RssShmem", 0) - base["RssShmem"],
                "left_after_bytes": after["VmRSS"] - base["VmRSS"],
            }
        )

    def ours(everything: bool) -> Callable[[Callable[..., None]], None]:
        def run(consume: Callable[..., None]) -> None:
            with get_tensors_parallel(tensor, ranks, transport="shm") as got:
                if got:
                    consume(got[1:], everything=everything)

        return run

    def gather(consume: Callable[..., None]) -> None:
        outputs = [torch.empty_like(tensor) for _ in ranks] if ctx.first else None
        dist.gather(tensor, outputs, dst=0)
        if outputs is not None:
            consume(outputs[1:])

    def gather_object(consume: Callable[..., None]) -> None:
        objects: list[Any] | None = [None] * ctx.world if ctx.first else None
        dist.gather_object(tensor, objects, dst=0)
        if objects is not None:
            consume(objects[1:])

    one("ours", "ours get_tensors_parallel, reads every byte", ours(True))
    one("ours_touch", "ours get_tensors_parallel, touches one element", ours(False))
    one("gather", "dist.gather (outputs allocated in the call)", gather)
    one("gather_object", "dist.gather_object", gather_object)
    if ctx.mo_distribute is not None:
        mo = ctx.mo_distribute

        def modelopt(consume: Callable[..., None]) -> None:
            with mo.get_tensors_parallel(tensor, ranks, None) as got:
                if got:
                    consume(got[1:])

        one("modelopt", "ModelOpt get_tensors_parallel", modelopt)
    if ctx.first:
        ctx.report["memory"] = results


# ---------------------------------------------------------------------------------- write costs


def write_costs(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """One process alone: what moving ``nbytes`` through a ``/dev/shm`` segment costs, step by step.

    The sender's ways of filling a fresh segment (ours is ``posix_fallocate`` + ``pwritev``),
    the same write into pages already allocated and touched (a reused segment), and the reader's
    first read through a fresh mapping (page faults) against alternatives. Median and minimum of
    ``repeats``; segments are removed as it goes.
    """
    source = bulk_tensor(0, nbytes).view(torch.int32)
    data = memoryview((ctypes.c_ubyte * nbytes).from_address(source.data_ptr())).cast("B")
    path = os.path.join(SHM_DIR, f"bench_gather_costs_{os.getpid()}")
    results: list[dict[str, Any]] = []

    def record(name: str, times: list[float]) -> None:
        results.append(cost_row(name, times, nbytes))

    @contextlib.contextmanager
    def segment(written: bool) -> Iterator[int]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if written:
                os.pwritev(fd, [data], 0)
            yield fd
        finally:
            os.close(fd)
            os.unlink(path)

    def fresh(step: Callable[[int], object]) -> list[float]:
        times = []
        for _ in range(repeats):
            with segment(written=False) as fd:
                start = time.perf_counter()
                step(fd)
                times.append(time.perf_counter() - start)
        return times

    record("sender: posix_fallocate of a fresh segment", fresh(lambda fd: os.posix_fallocate(fd, 0, nbytes)))
    record(
        "sender: posix_fallocate + pwritev (ours: a new segment's first payload)",
        fresh(lambda fd: (os.posix_fallocate(fd, 0, nbytes), os.pwritev(fd, [data], 0))),
    )
    record("sender: pwritev alone (the file grows)", fresh(lambda fd: os.pwritev(fd, [data], 0)))
    with segment(written=True) as fd:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            os.pwritev(fd, [data], 0)
            times.append(time.perf_counter() - start)
        record("sender: pwritev into touched pages (a reused segment)", times)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mapped[:nbytes] = data
            times.append(time.perf_counter() - start)
        mapped.close()
        record("sender: copy into its own shared map of the reused segment (ours)", times)

        def first_read(flags: int, populate: bool) -> list[float]:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                if populate:
                    mapping.madvise(MADV_POPULATE_READ)
                view = torch.frombuffer(mapping, dtype=torch.int32)
                read_all([view])
                times.append(time.perf_counter() - start)
                del view
                mapping.close()
            return times

        record(
            "reader: map MAP_PRIVATE + first read (ours, page faults)", first_read(mmap.MAP_PRIVATE, False)
        )
        record("reader: map MAP_PRIVATE + MADV_POPULATE_READ + read", first_read(mmap.MAP_PRIVATE, True))
        record(
            "reader: map MAP_PRIVATE | MAP_POPULATE + read (copies)",
            first_read(mmap.MAP_PRIVATE | mmap.MAP_POPULATE, False),
        )
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read_all([source])
        times.append(time.perf_counter() - start)
    record("reader: read of pages already mapped (anonymous tensor)", times)
    payload = wire.encode(source)
    for name, carrier in (
        ("shared memory, a named segment", SharedMemoryTransport()),
        (f"the local disk ({local_dir()})", LocalDiskCarrier()),
    ):
        record(
            f"carrier: {name}: publish + fetch + read every byte", carrier_round(carrier, payload, repeats)
        )
    return results


def carrier_round(carrier: Any, payload: wire.EncodedPayload, repeats: int) -> list[float]:
    """Seconds of one carrier's whole round, ``repeats`` times: the sender publishes ``payload`` (a new
    file each time), the first rank fetches it through the carriers' registry, decodes it and reads
    every byte, the sender releases what is left."""
    times = []
    for i in range(repeats):
        token = f"{os.getpid() & 0xFFFF:04x}{i:012x}"
        start = time.perf_counter()
        sent = carriers.publish(carrier, token, 1, payload)
        buffer = carriers.Receiving(Context(first=0, seconds=60)).fetch(token, 1, sent.receipt)
        read_all([wire.decode(buffer)])
        sent.release(taken=True)
        times.append(time.perf_counter() - start)
        del buffer
    return times


def format_write_costs(results: list[dict[str, Any]], nbytes: int, where: str = f"through {SHM_DIR}") -> str:
    """The table of :func:`write_costs` (and of :func:`workspace_costs`)."""
    lines = [f"moving {nbytes // MIB} MiB {where}, one process alone"]
    width = max(58, *(len(r["step"]) for r in results))
    header = f"{'step':<{width}} {'median ms':>10} {'min ms':>8} {'GiB/s at min':>13}"
    lines += [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['step']:<{width}} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} {r['gib_per_s_at_min']:>13.2f}"
        )
    return "\n".join(lines)
