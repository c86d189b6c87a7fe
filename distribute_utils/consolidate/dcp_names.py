"""Internal. The output tensors of a DCP directory: plain DCP keys as they are, Megatron's torch_dist keys renamed to
Megatron's own TP1 x PP1 x EP1 state dict names (the rules are in :mod:`.dcp`'s docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LayoutError
from .specs import TensorSpec

__all__ = ["MEGATRON_NAMES", "DcpNaming", "Region", "model_order"]

#: Naming schemes for Megatron's layer norms: TransformerEngine's fused names, or the local spec's.
MEGATRON_NAMES = ("te", "local")
_STACKED_LAYERS = re.compile(r"(?<![^.])layers\.(?!\d)")
_STACKED_EXPERTS = "mlp.experts.experts."
_NOT_WEIGHTS = ("optimizer.", "rng_state", "rerun_state_machine")
_LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


@dataclass(frozen=True)
class Region:
    """One output tensor: the leading ``index`` of DCP entry ``key``."""

    key: str
    index: tuple[int, ...]


@dataclass(frozen=True)
class DcpNaming:
    """How the entries of one DCP directory become output tensors (:class:`~.dcp.DcpCheckpoint` holds the
    attributes of the same names).

    Attributes:
        root: the directory (for messages).
        megatron: whether it is Megatron's torch_dist (keys renamed).
        names: ``"te"`` or ``"local"`` layer-norm names (Megatron only).
        grouped_experts: whether experts are TE's grouped MLP (``args.moe_grouped_gemm``).
    """

    root: Path
    megatron: bool
    names: str
    grouped_experts: bool

    def entries(self, metadata: Any) -> list[tuple[str, Region, TensorSpec]]:
        """``(output name, region, spec)`` of every output tensor that DCP ``Metadata`` describes, in key
        order."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        out: list[tuple[str, Region, TensorSpec]] = []
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue  # bytes entries: _extra_state, RNG states, ...
            if self.megatron and ("_extra_state" in key or key.startswith(_NOT_WEIGHTS)):
                continue
            dtype = md.properties.dtype
            shape = tuple(md.size)
            if not self.megatron:
                out.append((key, Region(key, ()), TensorSpec(key, dtype, shape)))
                continue
            for name, index in self._megatron_names(key, shape):
                out.append((name, Region(key, index), TensorSpec(name, dtype, shape[len(index) :])))
        return out

    def _megatron_names(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """Output names of one Megatron key and the leading indices each takes."""
        names: list[tuple[str, tuple[int, ...]]] = [("", ())]
        rest = key
        while True:
            m = _STACKED_LAYERS.search(rest)
            e = rest.find(_STACKED_EXPERTS)
            if m is None and e < 0:
                break
            axis = len(names[0][1])
            if axis >= len(shape):
                raise LayoutError(
                    f"{self.root}: Megatron key '{key}' of shape {list(shape)} has more stacked axes "
                    "(layers., experts.) than dims"
                )
            if m is not None and (e < 0 or m.start() < e):
                head, rest = rest[: m.end()], rest[m.end() :]
                names = [(f"{n}{head}{i}.", (*idx, i)) for n, idx in names for i in range(shape[axis])]
            else:
                head, rest = rest[:e], rest[e + len(_STACKED_EXPERTS) :]
                if self.grouped_experts:  # TE's grouped MLP: experts.linear_fc1.weight<e>
                    return [
                        (f"{n}{head}mlp.experts.{rest}{i}", (*idx, i))
                        for n, idx in names
                        for i in range(shape[axis])
                    ]
                names = [
                    (f"{n}{head}mlp.experts.local_experts.{i}.", (*idx, i))
                    for n, idx in names
                    for i in range(shape[axis])
                ]
        if self.names == "local":
            rest = _LOCAL_NORMS.get(rest, rest)
        return [(n + rest, idx) for n, idx in names]


def model_order(item: tuple[str, Region, TensorSpec]) -> tuple[int, int]:
    """Embeddings, then layer by layer, then the rest (a stable sort keeps the key order within each)."""
    name, region, _ = item
    if name.startswith("embedding"):
        return (0, 0)
    return (1, region.index[0]) if region.index else (2, 0)
