#!/usr/bin/env python3
"""Benchmark ``distribute-utils consolidate`` on real megatron-core checkpoints against a naive baseline.

One run:

1. ``scripts/megatron_checkpoints.py`` writes a LLaMA-shaped model (case ``bench``: 16 layers, hidden 1024,
   SwiGLU, GQA, untied, float32, about 1.1 GiB) with megatron-core on ``--tp`` x ``--pp`` CPU ranks, in
   both formats Megatron-LM saves: legacy (``mp_rank_TT_PPP/model_optim_rng.pt``) and torch_dist (DCP);
2. for each format, in child processes, interleaved (baseline, ours, ours on N ranks, then again, for
   ``--repeats`` rounds; medians reported):

   * **baseline**, the naive consolidation: everything loaded into memory (legacy: ``torch.load`` of
     every file, ``weights_only=False`` as most scripts do; torch_dist: DCP's own whole-checkpoint load,
     as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does), the same merge rules
     (``torch.cat``), ``safetensors.torch.save_file`` of the whole model into one file, ``os.fsync``;
   * **ours**: the default command, ``distribute-utils consolidate IN OUT``;
   * **ours on ranks** (legacy only): the same with ``--nproc TP*PP`` local ranks;

   With ``--to-hf`` every method writes a Hugging Face ``LlamaForCausalLM`` checkpoint instead: the
   baseline converts its whole merged model in memory (:func:`naive_hf`: a conversion script of the kind
   users write, independent of the package's), ours is ``consolidate IN OUT --to hf`` (one streaming pass);

3. checks that every output holds the same tensors, bit for bit;
4. times ``distribute-utils consolidate`` on a tiny real checkpoint (the ``swiglu`` test case) end to end.

Wall time is measured around each child process (interpreter start and ``import torch`` included). Peak
memory is that of the **whole process tree** (the command and every rank it spawns): the largest sum of
the tree's resident set sizes, sampled every 10 ms (``psutil``); the targets are judged by it. Beside it,
with ``--pss``, the largest sum of their proportional set sizes (PSS): RSS counts a page that several
processes map in each of them (a sender's shared-memory segment and the first rank's map of it), PSS once in
all. Reading PSS walks each process's page tables every 10 ms, which slows the largest processes most (the
naive baseline's): compare the memory of such runs, not their times. A ``sync`` runs before each measured
step.

Usage::

    python scripts/bench_consolidate.py                      # about 4 minutes here
    python scripts/bench_consolidate.py --repeats 1 --json - # quicker, JSON on stdout
    python scripts/bench_consolidate.py --input DIR          # reuse DIR/legacy and DIR/torch_dist
    python scripts/bench_consolidate.py --to-hf              # Megatron to Hugging Face, both ways
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGET_TIME_RATIO = 0.8
TARGET_MEMORY_RATIO = 0.25
TARGET_TINY_SECONDS = 3.0
SCRIPTS = Path(__file__).resolve().parent


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def naive_hf(merged: dict[str, Any], args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole TP1 Megatron model, converted in memory as a user's script does: Llama's names, QKV split
    per query group, ``linear_fc1`` halves; and its config. (Independent of ``distribute_utils``' own
    conversion, so that the outputs' comparison checks both.)"""
    heads, groups, dim = args.num_attention_heads, args.num_query_groups, args.kv_channels
    hf: dict[str, Any] = {
        "model.embed_tokens.weight": merged.pop("embedding.word_embeddings.weight"),
        "model.norm.weight": merged.pop("decoder.final_layernorm.weight"),
    }
    if "output_layer.weight" in merged:
        hf["lm_head.weight"] = merged.pop("output_layer.weight")
    for name, t in merged.items():
        _, _, i, rest = name.split(".", 3)
        p = f"model.layers.{i}."
        if rest == "self_attention.linear_qkv.weight":
            g = t.view(groups, heads // groups + 2, dim, -1)
            hf[p + "self_attn.q_proj.weight"] = g[:, : heads // groups].reshape(heads * dim, -1)
            hf[p + "self_attn.k_proj.weight"] = g[:, -2].reshape(groups * dim, -1)
            hf[p + "self_attn.v_proj.weight"] = g[:, -1].reshape(groups * dim, -1)
        elif rest == "mlp.linear_fc1.weight":
            hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = t.chunk(2)
        else:
            hf[p + _NAIVE_NAMES[rest]] = t
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.ffn_hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": dim,
        "rms_norm_eps": args.norm_epsilon,
        "rope_theta": args.rotary_base,
        "max_position_embeddings": args.max_position_embeddings,
        "vocab_size": args.padded_vocab_size,
        "tie_word_embeddings": not args.untie_embeddings_and_output_weights,
    }
    return hf, config


_NAIVE_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def baseline_worker(fmt: str, input_dir: str, output_dir: str, to_hf: str = "") -> dict[str, Any]:
    """The naive consolidation, in this process: load everything, merge, (``to_hf``: convert in memory,
    :func:`naive_hf`), one save_file, fsync."""
    start = time.perf_counter()
    import torch
    from safetensors.torch import save_file

    from distribute_utils.consolidate import plan_checkpoint

    layout, plan = plan_checkpoint(input_dir)  # names and rules from metadata (no tensor data)
    merged: dict[str, torch.Tensor] = {}
    if fmt == "legacy":
        shards = {}
        for t, s in layout.shards():
            obj = torch.load(layout.file_for(t, s), map_location="cpu", weights_only=False)
            shards[(t, s)] = {k: v for k, v in obj["model"].items() if isinstance(v, torch.Tensor)}
        for e in plan:
            parts = [shards[(t, e.pp_rank)][e.local_name] for t in range(layout.tp)]
            merged[e.name] = e.rule.merge(e.name, parts) if len(parts) > 1 else parts[0]
    else:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        full: dict[str, Any] = {}  # dcp_to_torch_save's two lines: the whole checkpoint in memory
        _load_state_dict(
            full,
            storage_reader=FileSystemReader(input_dir),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
        for e in plan:
            region = layout.region(e.name)
            value = full[region.key]
            merged[e.name] = value[region.index] if region.index else value
    os.makedirs(output_dir, exist_ok=True)
    if to_hf:
        merged, config = naive_hf(merged, layout.model_args)
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            json.dump(config, f)
    path = os.path.join(output_dir, "model.safetensors")
    save_file({k: v.contiguous() for k, v in merged.items()}, path, metadata={"format": "pt"})
    _fsync(path)
    return {"seconds": time.perf_counter() - start, "tensors": len(merged)}


class _TreePeak:
    """Largest sum of RSS over a process and its descendants, sampled every 10 ms; and of their PSS
    (``/proc/<pid>/smaps_rollup``), where a page several of them map (a rank's shared-memory segment and
    the first rank's map of it) counts once in all: RSS counts it in each."""

    def __init__(self, pid: int, pss: bool) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self._pss = pss  # (reading smaps_rollup walks page tables: milliseconds per large process)
        self.peak = 0
        self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = pss = 0
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
                    pss += _pss(p.pid) if self._pss else 0
            self.peak, self.peak_pss = max(self.peak, total), max(self.peak_pss, pss)
            self._stop.wait(0.01)

    def stop(self) -> tuple[int, int | None]:
        """``(peak RSS sum, peak PSS sum or None when not sampled)``, in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_pss if self._pss else None


def _pss(pid: int) -> int:
    """``pid``'s proportional set size in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def _run(cmd: list[str], pss: bool) -> dict[str, Any]:
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = _TreePeak(proc.pid, pss)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    peak, peak_pss = sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"wall_s": wall, "tree_peak_bytes": peak, "tree_peak_pss_bytes": peak_pss, "stdout": out}


def _compare(a: Path, b: Path) -> int:
    """Number of tensors, after checking that both files hold the same ones bit for bit."""
    import torch
    from safetensors import safe_open

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        names = set(fa.keys())
        if names != set(fb.keys()):
            raise SystemExit(f"outputs differ in names: {sorted(names ^ set(fb.keys()))[:5]}")
        for name in names:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if (
                x.dtype != y.dtype
                or x.shape != y.shape
                or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            ):
                raise SystemExit(f"tensor '{name}' differs between {a} and {b}")
    return len(names)


def _bench_format(
    fmt: str, inp: Path, work: Path, ranks: int, repeats: int, to_hf: bool, pss: bool
) -> dict[str, Any]:
    hf = ["--to", "hf"] if to_hf else []
    cli = [sys.executable, "-m", "distribute_utils", "consolidate", str(inp), *hf]
    methods: dict[str, list[str]] = {
        "baseline": [sys.executable, __file__, "--baseline-worker", fmt, str(inp)],
        "ours": [*cli],
    }
    if fmt == "legacy":
        methods[f"ours_{ranks}_ranks"] = [*cli, "--nproc", str(ranks)]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for _ in range(repeats):
        for method, cmd in methods.items():
            out = work / f"{fmt}_{method}"
            shutil.rmtree(out, ignore_errors=True)
            if method == "baseline":
                tail = [str(out), *(["--to-hf"] if to_hf else [])]
            else:
                tail = [str(out), "--quiet", "--json"]
            runs[method].append(_run([*cmd, *tail], pss))
    identical = 0
    for method in methods:
        if method != "baseline":
            identical = _compare(
                work / f"{fmt}_baseline" / "model.safetensors", work / f"{fmt}_{method}" / "model.safetensors"
            )
    result: dict[str, Any] = {"identical_tensors": identical}
    for method, rs in runs.items():
        result[method] = {
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "tree_peak_bytes": statistics.median(r["tree_peak_bytes"] for r in rs),
            "tree_peak_pss_bytes": statistics.median(r["tree_peak_pss_bytes"] for r in rs) if pss else None,
            "walls": [round(r["wall_s"], 3) for r in rs],
        }
    base = result["baseline"]
    result["time_ratio"] = result["ours"]["wall_s"] / base["wall_s"]
    result["memory_ratio"] = result["ours"]["tree_peak_bytes"] / base["tree_peak_bytes"]
    return result


def _tiny(work: Path) -> float:
    tiny = work / "tiny"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "megatron_checkpoints.py"),
            str(tiny),
            "--case",
            "swiglu",
            "--no-truth",
        ],
        check=True,
        capture_output=True,
    )
    out = work / "tiny_out"
    return _run(
        [
            sys.executable,
            "-m",
            "distribute_utils",
            "consolidate",
            str(tiny / "legacy"),
            str(out),
            "--quiet",
            "--json",
        ]
    )["wall_s"]


def _table(r: dict[str, Any]) -> str:
    gib = r["bytes"] / 2**30
    load = r["load_average"]
    lines = [
        f"model: megatron-core GPTModel case '{r['case']}', {r['tensors']} tensors, {gib:.2f} GiB, "
        f"TP {r['tp']} x PP {r['pp']}; medians of {r['repeats']} interleaved runs; load average "
        f"{load[0]:.1f} before, {load[1]:.1f} after",
        "",
        "| format | method | wall s | peak memory of the process tree MiB | its peak PSS MiB |",
        "|---|---|---:|---:|---:|",
    ]
    labels = {
        "baseline": "naive: load all, torch.cat, save_file",
        "ours": "`distribute-utils consolidate` (default)",
    }
    if r.get("to_hf"):
        labels = {
            "baseline": "naive: load all, torch.cat, convert in memory, save_file",
            "ours": "`distribute-utils consolidate --to hf`",
        }
    for fmt in ("legacy", "torch_dist"):
        for method, m in r[fmt].items():
            if not isinstance(m, dict):
                continue
            hf = " --to hf" if r.get("to_hf") else ""
            label = labels.get(method, f"`consolidate --nproc {r['tp'] * r['pp']}{hf}`")
            lines.append(
                f"| {fmt} | {label} | {m['wall_s']:.2f} | {m['tree_peak_bytes'] / 2**20:.0f} "
                f"| {'-' if m['tree_peak_pss_bytes'] is None else round(m['tree_peak_pss_bytes'] / 2**20)} |"
            )
    lines.append("")
    for fmt in ("legacy", "torch_dist"):
        t, m = r[fmt]["time_ratio"], r[fmt]["memory_ratio"]
        lines.append(
            f"{fmt}: time ours / naive {t:.2f}x (target <= {TARGET_TIME_RATIO}: "
            f"{'PASS' if t <= TARGET_TIME_RATIO else 'FAIL'}), peak memory {m:.2f}x (target <= "
            f"{TARGET_MEMORY_RATIO}: {'PASS' if m <= TARGET_MEMORY_RATIO else 'FAIL'}), outputs identical "
            f"({r[fmt]['identical_tensors']} tensors, bit for bit)"
        )
    tiny = r["tiny_s"]
    lines.append(
        f"tiny checkpoint (TP 2 x PP 2, 0.3 MiB), end to end: {tiny:.2f} s "
        f"(target < {TARGET_TINY_SECONDS}: {'PASS' if tiny < TARGET_TINY_SECONDS else 'FAIL'})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="bench", help="megatron_checkpoints.py case (default bench)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--input", default=None, help="reuse a directory with legacy/ and torch_dist/")
    parser.add_argument("--tmpdir", default="/tmp", help="where the temporary directory goes (default /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="FILE", help="JSON results ('-': stdout)"
    )
    parser.add_argument(
        "--to-hf",
        action="store_true",
        help="every method writes a Hugging Face LlamaForCausalLM checkpoint: the naive one converts in memory",
    )
    parser.add_argument(
        "--pss",
        action="store_true",
        help="also sample the tree's PSS (slows the sampled runs: compare memory only, not time)",
    )
    parser.add_argument("--baseline-worker", nargs=3, metavar=("FMT", "IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_worker:
        print(json.dumps(baseline_worker(*args.baseline_worker, to_hf="hf" if args.to_hf else "")))
        return 0

    work = Path(tempfile.mkdtemp(prefix="du_bench_consolidate_", dir=args.tmpdir))
    try:
        src = Path(args.input) if args.input else work / "checkpoint"
        if not args.input:
            t = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    str(SCRIPTS / "megatron_checkpoints.py"),
                    str(src),
                    "--case",
                    args.case,
                    "--tp",
                    str(args.tp),
                    "--pp",
                    str(args.pp),
                    "--no-truth",
                ],
                check=True,
            )
            print(f"wrote the checkpoints in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        from distribute_utils.consolidate import plan_checkpoint

        _, plan = plan_checkpoint(src / "torch_dist")
        result: dict[str, Any] = {
            "case": args.case,
            "tp": args.tp,
            "pp": args.pp,
            "repeats": args.repeats,
            "to_hf": args.to_hf,
            "tensors": len(plan),
            "bytes": sum(e.spec.nbytes for e in plan),
        }
        load_before = os.getloadavg()[0]
        for fmt in ("legacy", "torch_dist"):
            result[fmt] = _bench_format(
                fmt, src / fmt, work, args.tp * args.pp, args.repeats, args.to_hf, args.pss
            )
        result["tiny_s"] = _tiny(work)
        result["load_average"] = [load_before, os.getloadavg()[0]]
        print(_table(result))
        if args.json:
            text = json.dumps(result, indent=2)
            if args.json == "-":
                print(text)
            else:
                Path(args.json).write_text(text + "\n")
        ok = (
            all(
                result[f]["time_ratio"] <= TARGET_TIME_RATIO
                and result[f]["memory_ratio"] <= TARGET_MEMORY_RATIO
                for f in ("legacy", "torch_dist")
            )
            and result["tiny_s"] < TARGET_TINY_SECONDS
        )
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
