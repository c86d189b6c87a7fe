"""ModelOpt's own export postprocessing, end to end: with its helpers, and with ours patched in.

On 4 local ranks (TP2 x PP2, laid out [pp, tp] as ModelOpt assumes), each rank builds its shard
of a llama-style model with ModelOpt's own config dataclasses (bfloat16, FP8 scales) and runs
``modelopt.torch.export.postprocess.postprocess_model_config`` down to TP1 x PP1, once with
ModelOpt's ``get_configs_parallel`` / ``get_tensors_parallel`` and once with
:mod:`distribute_utils.modelopt` patched into ``modelopt.torch.export.postprocess`` (the
same calls, the same merges). Repetitions alternate between the two; the time is rank 0's,
barrier to barrier (GPU work synchronised before the end barrier), the order alternating per round;
every round's merged models are compared leaf by leaf (tensors bit for bit and device for device,
every other field by value), and a difference makes the exit status 1. Also printed: rank 0's time
inside the gathers of each kind (from the helper's call until it yields: ``get_tensors_parallel`` for the
tensor-parallel merges, ``get_configs_parallel`` for the pipeline merges), and which carrier brought ours
each payload rank 0 fetched, with its bytes (counted through :func:`distribute_utils.transports.carriers.inject`).
With ``--device cuda`` every rank's shard is on a GPU (rank r on ``cuda:<r mod the GPU count>``:
4 ranks share one GPU where there is one), as real exports run.

    python scripts/bench_modelopt_export.py                       # hidden 1024, 4 layers per stage
    python scripts/bench_modelopt_export.py --hidden 512 --layers 2 --reps 3
    python scripts/bench_modelopt_export.py --device cuda         # shards on the GPU

The model builder (:func:`shard`) is also what ``tests/test_modelopt.py`` exports.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tensor(shape: tuple[int, ...], *seed: int) -> torch.Tensor:
    """A reproducible bfloat16 tensor (the same on every process for the same seed)."""
    gen = torch.Generator().manual_seed(hash(seed) % 2**31)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def linear(mc: Any, kind: str, shape: tuple[int, ...], quant: str, *seed: int) -> Any:
    """A ModelOpt ``LinearConfig``; with ``quant="fp8"``, scalar FP8 scaling factors; with
    ``"int4_awq"``, per-block weight scales and per-input-channel pre-quant scales (block 16);
    ``"int8_sq"`` (SmoothQuant) and ``"nvfp4"`` as ModelOpt's export writes them."""
    config = mc.LinearConfig(linear_type=kind, weight=tensor(shape, *seed))
    if quant == "int4_awq":
        out_features, in_features = shape
        config.quantization = "int4_awq"
        config.awq_block_size = 16
        config.weights_scaling_factor = tensor((out_features, in_features // 16), *seed, 2).abs() + 0.5
        config.prequant_scaling_factor = tensor((in_features,), *seed, 3).abs() + 0.5
    if (
        quant == "int8_sq"
    ):  # per-channel weight scales; column linears' pre-quant scales alike on every TP rank
        out_features, in_features = shape
        config.quantization = "int8_sq"
        config.weights_scaling_factor = tensor((out_features,), *seed, 2).float().abs() + 0.5
        config.activation_scaling_factor = (tensor((), *seed, 1).float().abs() + 1).reshape(())
        config.prequant_scaling_factor = tensor((in_features,), seed[0], 3).abs() + 0.5
    if quant == "nvfp4":  # FP8 per-block (16) weight scales, a global second scale
        out_features, in_features = shape
        config.quantization = "nvfp4"
        config.awq_block_size = 16
        config.weights_scaling_factor = (
            tensor((out_features, in_features // 16), *seed, 2).float().abs() + 0.5
        ).to(torch.float8_e4m3fn)
        config.weights_scaling_factor_2 = (tensor((), *seed, 4).float().abs() + 1).reshape(())
        config.activation_scaling_factor = (tensor((), *seed, 1).float().abs() + 1).reshape(())
    if quant == "fp8":
        config.quantization = "fp8"
        config.activation_scaling_factor = (tensor((), *seed, 1).float().abs() + 1).reshape(())
        config.weights_scaling_factor = (tensor((), *seed, 2).float().abs() + 1).reshape(())
    return config


def shard(tp: int, pp: int, quant: str, hidden: int, ffn: int, vocab: int, layers: int) -> Any:
    """This rank's shard of a llama-style model, laid out [pp, tp] as ModelOpt assumes."""
    from modelopt.torch.export import model_config as mc

    rank = dist.get_rank()
    t, p = rank % tp, rank // tp
    col, row = mc.LINEAR_COLUMN, mc.LINEAR_ROW
    decoder = []
    for i in range(layers):
        n = p * layers + i
        qkv = mc.QKVConfig(
            q=linear(mc, col, (hidden // tp, hidden), quant, n, t, 0),
            k=linear(mc, col, (hidden // 2 // tp, hidden), quant, n, t, 1),
            v=linear(mc, col, (hidden // 2 // tp, hidden), quant, n, t, 2),
        )
        layer = mc.DecoderLayerConfig(decoder_type="llama", num_attention_heads=4, num_kv_heads=2)
        layer.attention = mc.AttentionConfig(
            qkv=qkv, dense=linear(mc, row, (hidden, hidden // tp), quant, n, t, 3)
        )
        layer.mlp = mc.MLPConfig(
            fc=linear(mc, col, (ffn // tp, hidden), quant, n, t, 4),
            gate=linear(mc, col, (ffn // tp, hidden), quant, n, t, 5),
            proj=linear(mc, row, (hidden, ffn // tp), quant, n, t, 6),
            hidden_act="silu",
        )
        layer.input_layernorm = mc.LayernormConfig(weight=tensor((hidden,), n, 7))
        layer.post_layernorm = mc.LayernormConfig(weight=tensor((hidden,), n, 8))
        decoder.append(layer)
    model = mc.ModelConfig(
        dtype="bfloat16", vocab_size=vocab, tensor_parallel=tp, pipeline_parallel=pp, rank=rank
    )
    model.layers = decoder
    if p == 0:
        model.vocab_embedding = mc.EmbeddingConfig(weight=tensor((vocab // tp, hidden), 100, t))
    if p == pp - 1:
        model.ln_f = mc.LayernormConfig(weight=tensor((hidden,), 101))
        model.lm_head = linear(mc, mc.LINEAR_COLUMN, (vocab // tp, hidden), quant, 102, t)
    return model


def moved(value: Any, device: torch.device) -> Any:
    """``value`` (a ModelOpt config tree) with every tensor on ``device``; dataclasses changed in place."""
    import dataclasses

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            setattr(value, f.name, moved(getattr(value, f.name), device))
        return value
    if isinstance(value, list):
        return [moved(v, device) for v in value]
    return value


def rank_device(kind: str) -> torch.device:
    """This rank's device: the CPU, or ``cuda:<rank mod the GPU count>``."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())


def timed(helper: Callable[..., Any], name: str, spent: dict[str, float]) -> Callable[..., Any]:
    """``helper`` (a gather's context manager), adding to ``spent[name]`` the seconds from its call until
    it yields the gathered values (the gather itself; the caller's merge inside the block and the helper's
    exit, e.g. ModelOpt's barrier and unlink, are not counted)."""

    @contextlib.contextmanager
    def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
        start = time.perf_counter()
        with helper(*args, **kwargs) as value:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            yield value

    return wrapper


def export(
    model: Any, pp: int, helpers: str, workspace: str | None = None, spent: dict[str, float] | None = None
) -> list[Any]:
    """``postprocess_model_config`` to TP1, with ModelOpt's helpers ("modelopt") or ours ("ours"); with
    ``spent``, the time inside its gathers is added there ("tensors": ``get_tensors_parallel``, ModelOpt's
    tensor-parallel merges; "configs": ``get_configs_parallel``, its pipeline merges)."""
    import modelopt.torch.export.distribute as theirs
    import modelopt.torch.export.postprocess as post

    from distribute_utils import modelopt as ours

    impl = ours if helpers == "ours" else theirs
    saved = post.get_configs_parallel, post.get_tensors_parallel
    post.get_configs_parallel, post.get_tensors_parallel = (
        impl.get_configs_parallel,
        impl.get_tensors_parallel,
    )
    if spent is not None:
        post.get_configs_parallel = timed(impl.get_configs_parallel, "configs", spent)
        post.get_tensors_parallel = timed(impl.get_tensors_parallel, "tensors", spent)
    try:
        return post.postprocess_model_config(
            model, inference_tensor_parallel=1, training_pipeline_parallel=pp, workspace_path=workspace
        )
    finally:
        post.get_configs_parallel, post.get_tensors_parallel = saved


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a config tree: tensors as (dtype, shape, device, bytes), the rest by repr."""
    import dataclasses

    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {path: (str(value.dtype), tuple(value.shape), str(value.device), data)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {f"{path}:type": type(value).__name__}
        for f in dataclasses.fields(value):
            out.update(flatten(getattr(value, f.name), f"{path}.{f.name}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {f"{path}:len": len(value)}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{path}[{i}]"))
        return out
    if isinstance(value, dict):
        out = {f"{path}:keys": repr(list(value))}
        for k, v in value.items():
            out.update(flatten(v, f"{path}[{k!r}]"))
        return out
    return {path: repr(value)}


def _rank_main(sizes: dict[str, int], reps: int, device_kind: str) -> dict[str, Any]:
    import io

    from distribute_utils.transports import carriers

    times: dict[str, list[float]] = {"modelopt": [], "ours": []}
    inside: dict[str, list[dict[str, float]]] = {"modelopt": [], "ours": []}  # per round: time in gathers
    routes: dict[str, list[int]] = {}  # ours, rank 0: carrier kind -> [payloads, bytes] over timed rounds
    counting = False

    def count(point: str, rank: int, carrier: Any, value: Any) -> None:
        if point == "fetched" and counting:
            route = routes.setdefault(carrier.kind, [0, 0])
            route[0] += 1
            route[1] += (
                value.numel() * value.element_size() if isinstance(value, torch.Tensor) else len(value)
            )

    carriers.inject(count)  # (the carriers' documented hook: here it only counts what rank 0 fetched)
    differing: list[str] = []  # rank 0: every round's leaves that differ between the two
    nbytes = 0
    quiet = contextlib.redirect_stdout(io.StringIO())  # ModelOpt prints a line per rank and step
    for i in range(reps + 1):  # the first round warms up both
        results: dict[str, dict[str, Any]] = {}
        for helpers in ("modelopt", "ours") if i % 2 else ("ours", "modelopt"):
            model = shard(2, 2, "fp8", sizes["hidden"], sizes["ffn"], sizes["vocab"], sizes["layers"])
            model = moved(model, rank_device(device_kind))
            if device_kind == "cuda":
                torch.cuda.synchronize()
            spent: dict[str, float] = {"tensors": 0.0, "configs": 0.0}
            counting = bool(i) and helpers == "ours"
            dist.barrier()
            t0 = time.perf_counter()
            with quiet:
                merged = export(model, 2, helpers, spent=spent)
            if device_kind == "cuda":
                torch.cuda.synchronize()  # the merges' queued GPU work is part of the export
            dist.barrier()
            if i:
                times[helpers].append(time.perf_counter() - t0)
                inside[helpers].append(spent)
            if merged:  # (rank 0), outside the timed window
                results[helpers] = flatten(merged)
                nbytes = sum(len(v[3]) for v in results[helpers].values() if isinstance(v, tuple))
            del merged, model
        if results:
            a, b = results["modelopt"], results["ours"]
            differing += [f"round {i}: {k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    carriers.inject(None)
    return {
        "medians": {k: statistics.median(v) for k, v in times.items()},
        "inside": {
            k: {name: statistics.median(r[name] for r in rounds) for name in ("tensors", "configs")}
            for k, rounds in inside.items()
        },
        "routes": {kind: [n // reps, b // reps] for kind, (n, b) in routes.items()},
        "differing": differing,
        "bytes": nbytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers per pipeline stage")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the shards are")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_modelopt_export: --device cuda needs a CUDA device; none here")
        return 2
    from distribute_utils.launch import run_local

    sizes = {"hidden": args.hidden, "ffn": args.ffn, "vocab": args.vocab, "layers": args.layers}
    report = run_local(_rank_main, 4, sizes, args.reps, args.device)[0]
    m = report["medians"]
    print(
        f"ModelOpt postprocess_model_config, TP2 x PP2 -> TP1 on 4 ranks, {args.layers * 2} layers, "
        f"hidden {args.hidden}, merged model {report['bytes'] / 2**20:.0f} MiB, FP8 scales, shards on "
        + (torch.cuda.get_device_name() if args.device == "cuda" else "the CPU")
    )
    print(f"  with ModelOpt's helpers: {m['modelopt'] * 1e3:9.1f} ms (median of {args.reps})")
    print(f"  with ours              : {m['ours'] * 1e3:9.1f} ms")
    for helpers, label in (("modelopt", "ModelOpt's helpers"), ("ours", "ours")):
        got = report["inside"][helpers]
        print(
            f"  inside {label + ' gathers:':<27} get_tensors_parallel (TP merges) {got['tensors'] * 1e3:8.1f} ms, "
            f"get_configs_parallel (PP merges) {got['configs'] * 1e3:8.1f} ms (rank 0, median per export)"
        )
    for kind, (payloads, nbytes) in sorted(report["routes"].items()):
        print(
            f"  ours, rank 0 fetched per export by {kind:<9}: {payloads:3d} payloads, {nbytes / 2**20:8.1f} MiB"
        )
    differing = report["differing"]
    print(
        f"  ratio: ours {m['modelopt'] / m['ours']:.2f}x faster; merged models identical (every leaf, bytes "
        f"and devices, every round): {not differing}"
    )
    for line in differing[:10]:
        print(f"  DIFFERS: {line}")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
