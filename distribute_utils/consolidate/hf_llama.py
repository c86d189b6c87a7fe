"""Internal. Megatron GPT of the Llama family to a Hugging Face ``LlamaForCausalLM`` checkpoint: its
``config.json`` from the checkpoint's own facts, and each consolidated tensor's place in it.

:func:`plan_hf` runs on every rank from metadata alone, after the merge plan and before anything is
written: it refuses what the converter does not know, naming the tensor or the fact. Rank 0's writer
then gets, for each merged (TP1) Megatron tensor, its Hugging Face pieces from :meth:`HfConversion.pieces`
(views, one tensor at a time: never the model in memory).

Megatron's TP1 layouts, and where they go:

- ``decoder.layers.N.self_attention.linear_qkv.weight``: ``[groups * (heads/groups + 2) * head_dim,
  hidden]``, for each query group its heads' queries, then its key, then its value (each TP rank holds
  whole groups; the merge keeps their order) -> ``q_proj`` ``[heads * head_dim, hidden]``, ``k_proj`` and
  ``v_proj`` ``[groups * head_dim, hidden]``;
- ``decoder.layers.N.mlp.linear_fc1.weight`` (SwiGLU): ``[gate; up]`` (the merge joins every TP rank's
  gate rows, then the up rows) -> ``gate_proj``, ``up_proj``;
- ``embedding.word_embeddings.weight``, ``output_layer.weight``: rows past ``vocab_size`` (when given,
  the tokenizer's size) are Megatron's padding, dropped; a tied output layer is not written
  (``tie_word_embeddings``);
- norms (Megatron's local names or TransformerEngine's fused ``layer_norm_weight``), ``linear_proj``,
  ``linear_fc2``: renamed.

The facts: Megatron-LM's ``args`` (a legacy file's, torch_dist's ``common.pt``) and the tensors' shapes;
what neither gives is asked of the caller (``hf_config``), never assumed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConversionError
from .merge_plan import MergePlanEntry
from .specs import TensorSpec

__all__ = ["GIVEN_KEYS", "HF_TARGETS", "HfConversion", "parse_given", "plan_hf"]

HF_TARGETS = ("hf",)
"""What ``to=`` converts to: ``"hf"``, a ``transformers`` ``LlamaForCausalLM`` directory."""

GIVEN_KEYS: dict[str, str] = {
    "hidden_act": "silu: the MLP's activation is Llama's (asked when the checkpoint has no args to say so)",
    "num_attention_heads": "query heads",
    "num_key_value_heads": "key/value heads (Megatron's query groups)",
    "head_dim": "channels per head (Megatron's kv_channels)",
    "rms_norm_eps": "RMSNorm's epsilon (Megatron's norm_epsilon)",
    "rope_theta": "RoPE's base (Megatron's rotary_base)",
    "rope_scaling": 'RoPE scaling as transformers writes it, or null (Megatron\'s use_rope_scaling: {"rope_type": "llama3", ...})',
    "max_position_embeddings": "longest sequence",
    "vocab_size": "the tokenizer's vocabulary: the embedding's padded rows past it are dropped",
    "tie_word_embeddings": "the output layer is the embedding",
    "bos_token_id": "first token (also in generation_config.json)",
    "eos_token_id": "end token, or a list (also in generation_config.json)",
    "pad_token_id": "padding token (also in generation_config.json)",
}
"""What the caller may give (``--hf-config KEY=VALUE``): facts the checkpoint lacks, and the tokenizer's."""

_FREE_KEYS = ("max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
"""Given keys that may differ from what the checkpoint says (a longer context, a trimmed vocabulary)."""

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_RENAMED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_EXTRA = "._extra_state"
_QKV, _FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"
_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_EMBEDDING, _OUTPUT, _FINAL_NORM = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "decoder.final_layernorm.weight",
)
_WHY_NOT = (
    (re.compile(r"experts|router"), "a mixture-of-experts layer (Llama's MLP is dense)"),
    (re.compile(r"q_layernorm|k_layernorm"), "QK layer norm (Llama has none)"),
    (re.compile(r"position_embeddings"), "learned absolute positions (Llama uses RoPE)"),
    (re.compile(r"norm\.bias$|layer_norm_bias$"), "a LayerNorm bias (Llama uses RMSNorm)"),
    (re.compile(r"bias$"), "a bias (Llama's linear layers have none: Megatron's add_bias_linear)"),
)


def parse_given(items: Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``KEY=VALUE`` strings (``--hf-config``; VALUE read as JSON, else as a string) or a mapping, checked
    against :data:`GIVEN_KEYS`.

    Raises:
        ConversionError: an unknown key (the valid ones listed), or an item without ``=``."""
    if items is None:
        return {}
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        for item in items:
            key, sep, text = str(item).partition("=")
            if not sep or not key:
                raise ConversionError(f"--hf-config takes KEY=VALUE, got {item!r}")
            try:
                value = json.loads(text)
            except ValueError:
                value = text
            pairs.append((key.strip(), value))
    for key, _ in pairs:
        if key not in GIVEN_KEYS:
            raise ConversionError(
                f"--hf-config {key}: not a key this converter takes; valid: {', '.join(GIVEN_KEYS)}"
            )
    return dict(pairs)


@dataclass
class HfConversion:
    """What :func:`plan_hf` decided: the output's tensors, the config, and what was renamed, split, trimmed
    or left out (for the report)."""

    config: dict[str, Any]
    specs: list[TensorSpec]
    _how: dict[str, tuple[str, tuple[str, ...]]] = field(repr=False)  # megatron name -> (how, hf names)
    split: list[str] = field(default_factory=list)
    trimmed: list[str] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)

    @property
    def files(self) -> dict[str, bytes]:
        """The small files written beside the weights: ``config.json``, and ``generation_config.json`` when
        a token id is known."""
        out = {"config.json": _json(self.config)}
        tokens = {
            k: self.config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if self.config.get(k) is not None
        }
        if tokens:
            out["generation_config.json"] = _json(tokens)
        return out

    def summary(self) -> dict[str, Any]:
        """For the report: ``{"to", "architecture", "renamed", "split", "trimmed", "config"}`` (each
        renamed and split tensor as ``"megatron name -> hf name(s)"``)."""
        return {
            "to": "hf",
            "architecture": self.config["architectures"][0],
            "renamed": [
                f"{m} -> {names[0]}" for m, (how, names) in self._how.items() if how in ("rename", "trim")
            ],
            "split": list(self.split),
            "trimmed": list(self.trimmed),
            "config": dict(self.config),
        }

    def renamed(self, entry: MergePlanEntry) -> MergePlanEntry | None:
        """``entry`` under its Hugging Face name when it goes there whole (renamed, or trimmed by no row):
        the writer then places it as any consolidation does (shards never joined in memory, a DCP tensor
        streamed); None when it is split, trimmed or left out (:meth:`pieces`)."""
        how, names = self._how.get(entry.name, ("drop", ()))
        if how == "rename" or (how == "trim" and entry.spec.shape[0] == self.config["vocab_size"]):
            return dataclasses.replace(
                entry, name=names[0], spec=dataclasses.replace(entry.spec, name=names[0])
            )
        return None

    def pieces(self, entry: MergePlanEntry, merged: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The Hugging Face tensors of one merged Megatron tensor (views of it where they can be). Rank 0's
        writer calls it once per plan entry; a tensor :func:`plan_hf` left out gives none."""
        how, names = self._how.get(entry.name, ("drop", ()))
        if how == "drop":
            return []
        if how == "rename":
            return [(names[0], merged)]
        if how == "trim":
            return [(names[0], merged[: self.config["vocab_size"]])]
        if how == "halves":
            half = merged.shape[0] // 2
            return [(names[0], merged[:half]), (names[1], merged[half:])]
        heads, groups, dim = (
            self.config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
        )
        grouped = merged.view(groups, heads // groups + 2, dim, merged.shape[-1])
        per = heads // groups
        return [
            (names[0], grouped[:, :per].reshape(heads * dim, -1)),
            (names[1], grouped[:, per].reshape(groups * dim, -1)),
            (names[2], grouped[:, per + 1].reshape(groups * dim, -1)),
        ]


def plan_hf(
    kind: str,
    args: Any,
    entries: Sequence[MergePlanEntry],
    given: Mapping[str, Any],
    swiglu: bool | None = None,
) -> HfConversion:
    """The conversion of a consolidation's ``entries`` (Megatron TP1 names) to ``LlamaForCausalLM``.

    Args:
        kind: the checkpoint's kind (``megatron_legacy`` or ``megatron_torch_dist``; others are refused).
        args: the checkpoint's Megatron-LM ``args`` (a ``Namespace``), or None.
        entries: the merge plan (after ``only`` / ``strip_prefix``).
        given: :func:`parse_given`'s: facts the checkpoint lacks, the tokenizer's vocabulary and tokens.
        swiglu: the caller's ``--swiglu`` / ``--no-swiglu`` (None: as ``args`` say).

    Raises:
        ConversionError: another architecture, a tensor with no place in a Llama checkpoint, or a fact
            missing or contradicted (each named, with the key that gives it).
    """
    if kind not in ("megatron_legacy", "megatron_torch_dist"):
        raise ConversionError(
            f"--to hf converts Megatron GPT checkpoints (legacy or torch_dist); this is a {kind} checkpoint: "
            "consolidate it without --to"
        )
    extra = [(e.name, "TransformerEngine's state, not a weight") for e in entries if e.name.endswith(_EXTRA)]
    entries = [e for e in entries if not e.name.endswith(_EXTRA)]
    specs = {e.name: e.spec for e in entries}
    _check_architecture(args, specs, swiglu)
    layers = sorted({int(m.group(1)) for m in map(_LAYER.fullmatch, specs) if m})
    config = _config(args, specs, layers, dict(given))
    how: dict[str, tuple[str, tuple[str, ...]]] = {}
    out: list[TensorSpec] = []
    split: list[str] = []
    trimmed: list[str] = []
    left_out: list[tuple[str, str]] = list(extra)
    for e in entries:
        placed = _place(e.name, config)
        if placed is None:
            left_out.append((e.name, "tied to the embedding (tie_word_embeddings)"))
            how[e.name] = ("drop", ())
            continue
        kind_of, names, shapes = placed(e.spec.shape)
        how[e.name] = (kind_of, names)
        out.extend(TensorSpec(n, e.spec.dtype, s) for n, s in zip(names, shapes, strict=True))
        if kind_of in ("halves", "qkv"):
            split.append(f"{e.name} -> {', '.join(names)}")
        if kind_of == "trim" and shapes[0] != e.spec.shape:
            trimmed.append(f"{e.name}: {e.spec.shape[0]} -> {shapes[0][0]} rows")
    _check_complete(out, layers, config)
    config["torch_dtype"] = str(specs[_EMBEDDING].dtype).removeprefix("torch.")
    return HfConversion(config, out, how, split, trimmed, left_out)


# -- facts --------------------------------------------------------------------------------------------------


def _arg(args: Any, name: str) -> Any:
    return None if args is None else getattr(args, name, None)


def _check_architecture(args: Any, specs: Mapping[str, TensorSpec], swiglu: bool | None) -> None:
    """Llama's structure, from ``args`` where they say, else from the tensors; anything else refused."""
    for name in specs:
        m = _LAYER.fullmatch(name)
        if name in (_EMBEDDING, _OUTPUT, _FINAL_NORM) or (m and m.group(2) in (*_RENAMED, _QKV, _FC1)):
            continue
        why = next(
            (why for pattern, why in _WHY_NOT if pattern.search(name)), "a tensor Llama has no place for"
        )
        raise ConversionError(
            f"tensor '{name}' is {why}: this checkpoint is not a Llama-family model; --to hf refuses it"
        )
    refusals = (
        ("normalization", lambda v: v not in (None, "RMSNorm"), "Llama uses RMSNorm"),
        ("position_embedding_type", lambda v: v not in (None, "rope"), "Llama uses RoPE"),
        ("num_experts", bool, "Llama's MLP is dense"),
        ("qk_layernorm", bool, "Llama has no QK layer norm"),
        ("multi_latent_attention", bool, "Llama uses grouped-query attention"),
        ("apply_layernorm_1p", bool, "zero-centred norm weights (w + 1) are not Llama's"),
        ("rotary_interleaved", bool, "Llama rotates halves, not interleaved pairs"),
        ("rotary_percent", lambda v: v not in (None, 1.0), "Llama rotates every channel"),
        (
            "rotary_seq_len_interpolation_factor",
            lambda v: v is not None,
            "this converter knows llama3 scaling only",
        ),
        ("add_qkv_bias", bool, "Llama's attention has no bias"),
        ("add_bias_linear", bool, "Llama's linear layers have no bias"),
        ("apply_residual_connection_post_layernorm", bool, "Llama's residual comes before its norm"),
        ("window_size", lambda v: v is not None, "Llama attends to the whole context, not a window"),
        ("softmax_type", lambda v: v not in (None, "vanilla"), "Llama's attention uses the plain softmax"),
        ("squared_relu", bool, "Llama's activation is SiLU"),
    )
    for name, bad, why in refusals:
        value = _arg(args, name)
        if bad(value):
            raise ConversionError(f"the checkpoint's args say {name}={value!r}; {why}: --to hf refuses it")
    gated = swiglu if swiglu is not None else _arg(args, "swiglu")
    if not gated:
        said = (
            "--no-swiglu was given"
            if swiglu is False
            else (
                "its args say swiglu=False"
                if args is not None and _arg(args, "swiglu") is False
                else "the checkpoint does not say (no args): give --swiglu if it is"
            )
        )
        raise ConversionError(f"Llama's MLP is SwiGLU; {said}")
    if args is None:
        return  # (the architecture is then what the caller asserts: see _config)
    if _arg(args, "normalization") is None or _arg(args, "position_embedding_type") is None:
        missing = [n for n in ("normalization", "position_embedding_type") if _arg(args, n) is None]
        raise ConversionError(
            f"the checkpoint's args do not say {' or '.join(missing)}: --to hf cannot tell a Llama model"
        )


def _config(
    args: Any, specs: Mapping[str, TensorSpec], layers: list[int], given: dict[str, Any]
) -> dict[str, Any]:
    """``config.json``: the tensors' shapes, the args' facts, then what was given (checked against both)."""
    if _EMBEDDING not in specs or _FINAL_NORM not in specs or not layers:
        missing = [n for n in (_EMBEDDING, _FINAL_NORM) if n not in specs] or ["decoder.layers.*"]
        raise ConversionError(f"the checkpoint has no {', '.join(missing)}: not a whole GPT model (--only?)")
    padded, hidden = specs[_EMBEDDING].shape
    ffn = specs.get(f"decoder.layers.{layers[0]}.mlp.linear_fc2.weight")
    shapes: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": ffn.shape[1] if ffn is not None else None,
        "num_hidden_layers": len(layers),
        "tie_word_embeddings": _OUTPUT not in specs,
    }
    said: dict[str, Any] = {}
    if args is not None:
        heads = _arg(args, "num_attention_heads")
        groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") is not False else heads
        scaling = None
        if _arg(args, "use_rope_scaling"):
            factor = _arg(args, "rope_scaling_factor")
            if factor is None:
                raise ConversionError("the checkpoint's args say use_rope_scaling but no rope_scaling_factor")
            # (megatron-core's llama3 scaling: low 1, high 4, original context 8192; transformers' names)
            scaling = {
                "rope_type": "llama3",
                "factor": float(factor),
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        said = {
            "hidden_size": _arg(args, "hidden_size"),
            "intermediate_size": _arg(args, "ffn_hidden_size"),
            "num_hidden_layers": _arg(args, "num_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": groups if groups is not None else heads,
            "head_dim": _arg(args, "kv_channels"),
            "rms_norm_eps": _arg(args, "norm_epsilon") or _arg(args, "layernorm_epsilon"),  # (older Megatron)
            "rope_theta": _arg(args, "rotary_base"),
            "rope_scaling": scaling,
            "max_position_embeddings": _arg(args, "max_position_embeddings") or _arg(args, "seq_length"),
            "tie_word_embeddings": (
                None
                if _arg(args, "untie_embeddings_and_output_weights") is None
                else not _arg(args, "untie_embeddings_and_output_weights")
            ),
            "vocab_size": _arg(args, "padded_vocab_size"),
        }
        said = {k: v for k, v in said.items() if v is not None or k == "rope_scaling"}
    config: dict[str, Any] = {}
    for key, value in shapes.items():
        if value is None:
            continue
        if key in said and said[key] != value:
            raise ConversionError(
                f"the checkpoint's args say {_megatron_name(key)}={said[key]!r}, its tensors {value!r}: "
                "not one model"
            )
        config[key] = value
    for key, value in said.items():
        config.setdefault(key, value)
    for key, value in given.items():
        if key in config and config[key] != value and key not in _FREE_KEYS:
            raise ConversionError(
                f"--hf-config {key}={json.dumps(value)} contradicts the checkpoint, which says {json.dumps(config[key])}"
            )
        config[key] = value
    if "head_dim" not in config and {"num_attention_heads", "num_key_value_heads"} <= set(config):
        config["head_dim"] = hidden // config["num_attention_heads"]  # (Megatron's rule for kv_channels)
    required = (
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    )
    missing = [k for k in (*required, "rope_scaling") if k not in config]
    if args is None and "hidden_act" not in given:  # (the args' swiglu says SiLU; --swiglu only says gated)
        missing.insert(0, "hidden_act")
    if missing:
        raise ConversionError(
            f"the checkpoint does not say {', '.join(missing)} (neither its Megatron args nor its tensors); "
            f"give each with --hf-config KEY=VALUE ({'; '.join(f'{k}: {GIVEN_KEYS[k]}' for k in missing)})"
        )
    if config.pop("hidden_act", "silu") != "silu":
        raise ConversionError(
            f"hidden_act {given['hidden_act']!r}: Llama's MLP is SwiGLU, its activation silu"
        )
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):  # (absent, transformers assumes 1 and 2)
        config.setdefault(token, None)
    vocab = config.setdefault("vocab_size", padded)
    if type(vocab) is not int or not 0 < vocab <= padded:
        raise ConversionError(f"vocab_size {vocab!r}: the embedding has {padded} rows; give 1 to {padded}")
    _check_heads(config, specs, layers[0])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        **dict(sorted(config.items())),
    }


def _megatron_name(key: str) -> str:
    return {
        "hidden_size": "hidden_size",
        "intermediate_size": "ffn_hidden_size",
        "num_hidden_layers": "num_layers",
        "tie_word_embeddings": "untie_embeddings_and_output_weights (inverted)",
    }.get(key, key)


def _check_heads(config: Mapping[str, Any], specs: Mapping[str, TensorSpec], layer: int) -> None:
    """Heads, groups and head size against the first layer's QKV shape; the MLP's size against its
    ``linear_fc1`` (gate and up)."""
    heads, groups, dim = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    for name in (_QKV, _FC1):
        if f"decoder.layers.{layer}.{name}" not in specs:
            raise ConversionError(
                f"the checkpoint has no decoder.layers.{layer}.{name}: not a whole GPT model"
            )
    fc1 = specs[f"decoder.layers.{layer}.{_FC1}"].shape[0]
    if fc1 != 2 * config["intermediate_size"]:
        raise ConversionError(
            f"decoder.layers.{layer}.{_FC1} has {fc1} rows, linear_fc2 takes {config['intermediate_size']}: "
            "not a gated MLP's [gate; up] (--swiglu given for a plain MLP?)"
        )
    qkv = specs.get(f"decoder.layers.{layer}.{_QKV}")
    if not all(isinstance(v, int) and v > 0 for v in (heads, groups, dim)) or heads % groups:
        raise ConversionError(
            f"num_attention_heads {heads!r}, num_key_value_heads {groups!r}, head_dim {dim!r}: positive ints, "
            "heads a multiple of key/value heads"
        )
    if qkv is None or qkv.shape[0] != (heads + 2 * groups) * dim:
        rows = None if qkv is None else qkv.shape[0]
        raise ConversionError(
            f"decoder.layers.{layer}.{_QKV} has {rows} rows; {heads} heads and {groups} key/value heads of "
            f"{dim} channels need {(heads + 2 * groups) * dim}: heads or groups are not this model's"
        )


# -- places -------------------------------------------------------------------------------------------------


def _place(name: str, config: Mapping[str, Any]) -> Any:
    """How ``name`` is written: a function of its shape giving ``(how, hf names, hf shapes)``; None: not
    written (a tied output layer)."""
    vocab = config["vocab_size"]
    if name == _EMBEDDING:
        return lambda s: ("trim", ("model.embed_tokens.weight",), [(vocab, *s[1:])])
    if name == _OUTPUT:
        if config["tie_word_embeddings"]:
            return None
        return lambda s: ("trim", ("lm_head.weight",), [(vocab, *s[1:])])
    if name == _FINAL_NORM:
        return lambda s: ("rename", ("model.norm.weight",), [s])
    m = _LAYER.fullmatch(name)
    assert m is not None  # (_check_architecture refused the rest)
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _RENAMED:
        return lambda s: ("rename", (prefix + _RENAMED[rest],), [s])
    if rest == _FC1:
        return lambda s: (
            "halves",
            (prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"),
            [(s[0] // 2, *s[1:])] * 2,
        )
    heads, groups, dim = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    return lambda s: (
        "qkv",
        tuple(prefix + f"self_attn.{p}_proj.weight" for p in "qkv"),
        [(heads * dim, s[1]), (groups * dim, s[1]), (groups * dim, s[1])],
    )


def _check_complete(specs: Sequence[TensorSpec], layers: list[int], config: Mapping[str, Any]) -> None:
    """Every weight ``LlamaForCausalLM`` has, once: layers numbered from 0 without a gap, each whole."""
    if layers != list(range(len(layers))):
        raise ConversionError(f"decoder layers {layers[:8]}...: not numbered 0 to {len(layers) - 1}")
    names = {s.name for s in specs}
    wanted = {"model.embed_tokens.weight", "model.norm.weight"}
    wanted |= {f"model.layers.{i}.{w}" for i in layers for w in _LAYER_WEIGHTS}
    if not config["tie_word_embeddings"]:
        wanted.add("lm_head.weight")
    missing = sorted(wanted - names)
    if missing:
        raise ConversionError(
            f"no Megatron tensor gives {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}: "
            "the checkpoint is not a whole Llama-family model"
        )
    if len(names) != len(specs):
        raise ConversionError(
            "two Megatron tensors give the same Hugging Face weight (e.g. a norm under both names)"
        )


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
