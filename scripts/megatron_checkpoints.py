#!/usr/bin/env python3
"""Writes real megatron-core checkpoints on CPU (gloo), and Megatron's own TP1 x PP1 view of them.

megatron-core itself builds the model (``GPTModel`` with the local, non-TransformerEngine layer spec) on
``tp * pp * ep``-shaped process groups and saves it, from the same weights, in both formats Megatron-LM
writes:

* **legacy** (``--ckpt-format torch``): ``iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` as
  Megatron-LM's ``save_checkpoint`` writes it: ``args`` (an ``argparse.Namespace`` holding Megatron's enums
  and ``signal.Signals``), ``checkpoint_version``, ``iteration``, ``model`` (or ``model0``, ``model1``, ...
  with a virtual pipeline) from ``state_dict_for_save_checkpoint()``, ``optimizer``,
  ``opt_param_scheduler``, ``rng_state`` (numpy and torch RNG states); written only where the expert
  data-parallel rank is 0, as Megatron does; ``latest_checkpointed_iteration.txt`` beside it;
* **torch_dist**: ``dist_checkpointing.save`` of the model's ``sharded_state_dict()``.

The ground truth is megatron-core's own reshard-on-load: a fresh TP1 x PP1 x EP1 model of the same config
``dist_checkpointing.load``-s the torch_dist checkpoint, and its ``state_dict()`` (tensors only,
``_extra_state`` left out) is written to ``truth.safetensors``; its forward of a fixed batch
(:data:`BATCH`, float32, causal) to ``logits.pt`` (``{"ids", "logits"}``: what a converted model must
give).

Needs ``pip install megatron-core==0.16.1 --no-deps`` (it imports nothing else that torch does not bring).

Usage::

    python scripts/megatron_checkpoints.py OUT --case swiglu --tp 2 --pp 2
    python scripts/megatron_checkpoints.py OUT --case moe --tp 2 --ep 2

Writes ``OUT/legacy``, ``OUT/torch_dist``, ``OUT/truth.safetensors`` and ``OUT/logits.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

#: Model configurations; every case is small (a few MiB) but has the structure it is named after.
CASES: dict[str, dict[str, Any]] = {
    # learned absolute positions, LayerNorm, biases, untied output layer
    "dense": dict(num_layers=4, untie=True),
    # GQA (2 query groups for 4 heads), tied embeddings, RoPE, RMSNorm, no biases
    "gqa": dict(num_layers=4, num_query_groups=2, untie=False, rope=True, rmsnorm=True, bias=False),
    # gated MLP (SwiGLU), as every LLaMA-family model
    "swiglu": dict(num_layers=4, swiglu=True, rope=True, rmsnorm=True, bias=False, num_query_groups=2),
    # uneven pipeline (for --pp 2): 5 layers, 3 on the first stage, 2 on the last
    "uneven": dict(num_layers=5, first_stage_layers=3, last_stage_layers=2, swiglu=True, untie=True),
    # Llama 3 as Megatron-LM trains it: untied output layer, plain multi-head attention (no query
    # groups), RoPE with llama3 scaling (--use-rope-scaling): the --to hf conversion's second case
    "llama": dict(
        num_layers=4, swiglu=True, rope=True, rmsnorm=True, bias=False, untie=True, rope_scaling=True
    ),
    # mixture of experts (4 experts, top-2), gated experts
    "moe": dict(num_layers=2, num_experts=4, swiglu=True, bias=False, untie=True),
    # scripts/bench_consolidate.py: a LLaMA-shaped model of about 1.1 GiB (float32)
    "bench": dict(
        num_layers=16,
        hidden=1024,
        ffn=4096,
        heads=8,
        num_query_groups=2,
        vocab=32000,
        swiglu=True,
        rope=True,
        rmsnorm=True,
        bias=False,
        untie=True,
    ),
}
VOCAB = 128
BATCH = (2, 16)  # the forward's batch and sequence length
BATCH_TOKENS = 96  # its token ids are below this (a tokenizer's size a conversion may trim the vocabulary to)
HIDDEN = 64
HEADS = 4
FFN = 128
SEQ = 32


def _cpu_only() -> None:
    """Quiet megatron-core's warnings; on a machine without CUDA, point the two CUDA calls its torch_dist
    writer makes (``synchronize()``, ``current_device()`` for a flag tensor) and the ``.cuda()`` of the tied
    embedding set-up at the CPU."""
    warnings.filterwarnings("ignore")
    import logging

    import torch

    logging.getLogger("megatron").setLevel(logging.ERROR)
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        import contextlib

        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        # (its attention forks the CUDA RNG for dropout: nothing to fork in eval on the CPU)
        get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def _config(case: dict[str, Any], tp: int, pp: int, ep: int, vp: int | None) -> Any:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=case["num_layers"],
        hidden_size=case.get("hidden", HIDDEN),
        num_attention_heads=case.get("heads", HEADS),
        ffn_hidden_size=case.get("ffn", FFN),
        num_query_groups=case.get("num_query_groups"),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=case.get("bias", True),
        gated_linear_unit=case.get("swiglu", False),
        activation_func=F.silu if case.get("swiglu") else F.gelu,
        normalization="RMSNorm" if case.get("rmsnorm") else "LayerNorm",
        pipeline_dtype=torch.float32,
    )
    if case.get("first_stage_layers") and pp > 1:
        kwargs["num_layers_in_first_pipeline_stage"] = case["first_stage_layers"]
        kwargs["num_layers_in_last_pipeline_stage"] = case["last_stage_layers"]
    if case.get("num_experts"):
        kwargs.update(num_moe_experts=case["num_experts"], moe_router_topk=2, moe_grouped_gemm=False)
    return TransformerConfig(**kwargs)


def _build(config: Any, case: dict[str, Any], vp: int | None) -> list[Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=case.get("num_experts"),
        moe_grouped_gemm=False,
        normalization="RMSNorm" if case.get("rmsnorm") else "LayerNorm",
    )
    chunks = []
    for v in range(vp or 1):
        vp_stage = v if vp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=case.get("vocab", VOCAB),
                max_sequence_length=SEQ,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=not case.get("untie", False),
                position_embedding_type="rope" if case.get("rope") else "learned_absolute",
                rope_scaling=case.get("rope_scaling", False),
                vp_stage=vp_stage,
            )
        )
    return chunks


def _args(
    case_name: str,
    case: dict[str, Any],
    tp: int,
    pp: int,
    ep: int,
    vp: int | None,
    ckpt_format: str = "torch",
) -> Any:
    """``args`` as Megatron-LM's argument parser leaves them (the fields a consolidation reads, and enums)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        case=case_name,
        num_layers=case["num_layers"],
        hidden_size=case.get("hidden", HIDDEN),
        ffn_hidden_size=case.get("ffn", FFN),
        num_attention_heads=case.get("heads", HEADS),
        group_query_attention=case.get("num_query_groups") is not None,
        num_query_groups=case.get("num_query_groups") or case.get("heads", HEADS),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        decoder_first_pipeline_num_layers=case.get("first_stage_layers"),
        decoder_last_pipeline_num_layers=case.get("last_stage_layers"),
        num_experts=case.get("num_experts"),
        moe_grouped_gemm=False,
        swiglu=case.get("swiglu", False),
        untie_embeddings_and_output_weights=case.get("untie", False),
        position_embedding_type="rope" if case.get("rope") else "learned_absolute",
        normalization="RMSNorm" if case.get("rmsnorm") else "LayerNorm",
        add_bias_linear=case.get("bias", True),
        padded_vocab_size=case.get("vocab", VOCAB),
        # (what Megatron-LM's parser and validate_args leave for the rest of the model's facts)
        kv_channels=case.get("hidden", HIDDEN) // case.get("heads", HEADS),
        norm_epsilon=1e-5,
        rotary_base=10000,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=case.get("rope_scaling", False),
        rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None,
        max_position_embeddings=SEQ,
        seq_length=SEQ,
        qk_layernorm=False,
        apply_layernorm_1p=False,
        add_qkv_bias=case.get("bias", True),
        transformer_impl="local",
        ckpt_format=ckpt_format,
        model_type=ModelType.encoder_or_decoder,
        attention_backend=AttnBackend.auto,
        exit_signal=signal.SIGTERM,
        params_dtype="torch.float32",
        world_size=tp * pp * ep,
    )


def _perturb(chunks: list[Any], tp_rank: int, pp_rank: int, ep_rank: int) -> None:
    """Distinct values in norms and biases (initialised to 1 and 0), equal wherever Megatron keeps replicas.

    A parameter's noise depends on its name, stage and chunk, and on the TP rank only where it is split
    (``tensor_model_parallel``), on the EP rank only where it is an expert's (``allreduce=False``).
    """
    import zlib

    import torch

    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                if "norm" not in name and "bias" not in name:
                    continue
                tp = tp_rank if getattr(p, "tensor_model_parallel", False) else -1
                ep = ep_rank if getattr(p, "allreduce", True) is False else -1
                seed = zlib.crc32(f"{name}|pp{pp_rank}|vp{v}|tp{tp}|ep{ep}".encode())
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def _rank_main(out: str, case_name: str, dims: tuple[int, ...]) -> None:
    """One rank of the writing job (started by :func:`distribute_utils.launch.run_local`, in its gloo group)."""
    _cpu_only()
    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    tp, pp, ep, vp_or_0 = dims
    vp = vp_or_0 or None
    case = CASES[case_name]
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,
        )
        torch.manual_seed(1234)
        config = _config(case, tp, pp, ep, vp)
        chunks = _build(config, case, vp)
        _perturb(
            chunks,
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
        )
        root = Path(out)
        # torch_dist: every rank takes part; replicas are deduplicated by megatron-core.
        (root / "torch_dist").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        # torch_dist, as Megatron-LM's save_checkpoint (torch_dist format) writes it: non-sharded entries
        # (args, iteration) go to common.pt, sharded tensors under their global keys.
        sharded: dict[str, Any] = {
            "args": _args(case_name, case, tp, pp, ep, vp, "torch_dist"),
            "checkpoint_version": 3.0,
            "iteration": 1,
        }
        for v, chunk in enumerate(chunks):
            sharded["model" if len(chunks) == 1 else f"model{v}"] = chunk.sharded_state_dict()
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
        dist_checkpointing.save(sharded, str(root / "torch_dist"), strategy)
        # legacy: as Megatron-LM's save_checkpoint (torch format) writes it.
        if ps.get_expert_data_parallel_rank() == 0:
            state: dict[str, Any] = {
                "args": _args(case_name, case, tp, pp, ep, vp),
                "checkpoint_version": 3.0,
                "iteration": 1,
            }
            for v, chunk in enumerate(chunks):
                state["model" if len(chunks) == 1 else f"model{v}"] = chunk.state_dict_for_save_checkpoint()
            params = [p for c in chunks for p in c.parameters()]
            opt = torch.optim.Adam(params)
            state["optimizer"] = opt.state_dict()
            state["opt_param_scheduler"] = {"max_lr": 3e-4, "num_steps": 1}
            state["rng_state"] = [
                {
                    "random_rng_state": __import__("random").getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "rng_tracker_states": {},
                }
            ]
            name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
            if pp > 1:
                name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
            if ep > 1:
                name += f"_{ps.get_expert_model_parallel_rank():03d}"
            path = root / "legacy" / "iter_0000001" / name / "model_optim_rng.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        dist.barrier()
        if dist.get_rank() == 0:
            (root / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    finally:
        ps.destroy_model_parallel()


def _truth_main(out: str, case_name: str) -> None:
    """The TP1 ground truth: megatron-core loads the torch_dist checkpoint resharded to one rank."""
    _cpu_only()
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    case = CASES[case_name]
    try:
        ps.initialize_model_parallel(1, 1)
        (model,) = _build(_config(case, 1, 1, 1, None), case, None)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(Path(out) / "torch_dist"))
        model.load_state_dict(loaded["model"])
        sd = {
            k: v.detach().contiguous()
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }
        save_file(sd, str(Path(out) / "truth.safetensors"))
        if not case.get("num_experts"):
            torch.save(_forward(model), Path(out) / "logits.pt")
    finally:
        ps.destroy_model_parallel()


def _forward(model: Any) -> dict[str, Any]:
    """Megatron's own forward of the TP1 model on a fixed batch: ``{"ids", "logits"}`` (float32, eval)."""
    import torch

    batch, seq = BATCH
    ids = torch.randint(0, BATCH_TOKENS, BATCH, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    causal = torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()  # (True: masked)
    model.eval()
    with torch.no_grad():
        logits = model(ids, positions, causal)
    return {"ids": ids, "logits": logits}


def write(
    out: str | os.PathLike[str],
    case: str,
    tp: int = 2,
    pp: int = 2,
    ep: int = 1,
    vp: int = 0,
    truth: bool = True,
) -> Path:
    """Writes ``out/legacy``, ``out/torch_dist`` and (with ``truth``) ``out/truth.safetensors``; returns ``out``."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; valid: {', '.join(CASES)}")
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    from distribute_utils.launch import run_local

    run_local(_rank_main, tp * pp * ep, os.fspath(root), case, (tp, pp, ep, vp))
    if truth:
        run_local(_truth_main, 1, os.fspath(root), case)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--case", choices=sorted(CASES), default="dense")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--vp", type=int, default=0, help="virtual pipeline chunks per stage (0: none)")
    parser.add_argument("--no-truth", action="store_true", help="skip Megatron's TP1 reshard")
    a = parser.parse_args(argv)
    write(a.out, a.case, a.tp, a.pp, a.ep, a.vp, truth=not a.no_truth)
    print(
        f"wrote {a.out}/legacy, {a.out}/torch_dist" + ("" if a.no_truth else f", {a.out}/truth.safetensors")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
