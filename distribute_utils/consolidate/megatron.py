"""Internal. Megatron-LM's legacy (``--ckpt-format torch``) checkpoints, as its ``save_checkpoint`` writes them.

Directory layout (``checkpointing.get_checkpoint_name``)::

    latest_checkpointed_iteration.txt        # "1234" or "release"
    iter_0001234/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt

``TT`` is the TP rank, ``PPP`` the PP rank (only when PP > 1), ``EEE`` the expert-parallel rank (only when
EP > 1). Each file is a ``torch.save`` of ``{"args": Namespace, "checkpoint_version", "iteration",
"model" (or "model0", "model1", ... with a virtual pipeline), "optimizer", "rng_state", ...}``; it is
read with :func:`~.safe_load.safe_torch_load` (nothing pickled runs) and only the model entries'
tensors are used.

``args`` says how the model was split, and is used instead of guessing (:class:`MegatronArgs`):
TP/PP/EP sizes, whether the MLP is gated (``swiglu``: ``linear_fc1`` is ``[gate; up]`` per TP rank),
whether embeddings are tied (then the last stage's ``output_layer.weight`` is a copy and is left out, as
a TP1 model has no such key), and the layer count. Global names follow Megatron at TP1 x PP1 x EP1:
decoder layers renumbered across stages and virtual chunks (chunk-major, as Megatron interleaves), experts
renumbered ``ep_rank * local_experts + i``; EP ranks' copies of the dense weights are taken from EP rank 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import LayoutError
from .grid import CheckpointLayout, atomic_torch_save, atomic_write_text, flatten_tensors, grid_of
from .merge_rules import bitwise_equal
from .safe_load import find_stand_ins, safe_torch_load
from .torch_writer import standalone

__all__ = [
    "MEGATRON_FILE",
    "TRACKER_FILE",
    "MegatronArgs",
    "MegatronLegacyLayout",
    "find_megatron_root",
    "open_megatron_legacy",
    "write_megatron_legacy",
]

logger = logging.getLogger(__name__)

#: File name inside each Megatron ``mp_rank_*`` directory.
MEGATRON_FILE = "model_optim_rng.pt"
#: The file naming the latest iteration.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
_MP_RE = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_ITER_RE = re.compile(r"iter_(\d{7})")
_CHUNK_RE = re.compile(r"model(\d+)/(.*)")
_LOCAL_EXPERT_RE = re.compile(r"(?<![^.])local_experts\.(\d+)\.")
_GROUPED_EXPERT_RE = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_TIED_COPY = "output_layer.weight"
_TIED_SOURCE = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class MegatronArgs:
    """What a consolidation needs from Megatron-LM's ``args`` (``None``: the checkpoint does not say).

    Attributes:
        tp, pp, ep: tensor-, pipeline- and expert-parallel sizes.
        etp: expert tensor-parallel size (Megatron defaults it to ``tp``).
        vp: virtual pipeline chunks per stage, or ``None``.
        swiglu: gated MLP.
        tied: embeddings and output layer share weights.
        num_layers: decoder layers in the whole model.
        num_experts: experts per MoE layer.
    """

    tp: int
    pp: int
    ep: int = 1
    etp: int | None = None
    vp: int | None = None
    swiglu: bool | None = None
    tied: bool | None = None
    num_layers: int | None = None
    num_experts: int | None = None

    @classmethod
    def from_namespace(cls, args: Any) -> MegatronArgs:
        """Reads an ``argparse.Namespace`` as Megatron-LM's ``arguments.py`` leaves it."""

        def get(name: str, default: Any = None) -> Any:
            value = getattr(args, name, default)
            return default if value is None else value

        untie = getattr(args, "untie_embeddings_and_output_weights", None)
        return cls(
            tp=int(get("tensor_model_parallel_size", 1)),
            pp=int(get("pipeline_model_parallel_size", 1)),
            ep=int(get("expert_model_parallel_size", 1)),
            etp=get("expert_tensor_parallel_size"),
            vp=get("virtual_pipeline_model_parallel_size"),
            swiglu=getattr(args, "swiglu", None),
            tied=None if untie is None else not untie,
            num_layers=get("num_layers"),
            num_experts=get("num_experts"),
        )


def find_megatron_root(path: Path, iteration: int | str | None) -> Path | None:
    """The directory holding ``mp_rank_*`` directories, or None when this is not a Megatron checkpoint.

    Looks at ``path`` itself, then ``latest_checkpointed_iteration.txt``, then the newest
    ``iter_NNNNNNN``; ``iteration`` (a number or ``"release"``) picks one explicitly.
    """
    if iteration is not None:
        sub = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
        if not (path / sub).is_dir():
            raise FileNotFoundError(f"Megatron checkpoint iteration directory '{path / sub}' does not exist")
        return path / sub
    if any(_MP_RE.fullmatch(p.name) for p in path.iterdir() if p.is_dir()):
        return path
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            sub = "release"
        elif text.isdigit():
            sub = f"iter_{int(text):07d}"
        else:
            raise LayoutError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
        if not (path / sub).is_dir():
            raise FileNotFoundError(f"{tracker} names iteration {text}, but '{path / sub}' does not exist")
        return path / sub
    iters = sorted(p.name for p in path.iterdir() if p.is_dir() and _ITER_RE.fullmatch(p.name))
    if iters:
        logger.info("%s: no %s; using the latest iteration directory %s", path, TRACKER_FILE, iters[-1])
        return path / iters[-1]
    return None


class MegatronLegacyLayout(CheckpointLayout):
    """Megatron-LM's legacy checkpoint (see the module docstring); open it with :func:`open_megatron_legacy`.

    Attributes:
        args: what the checkpoint's ``args`` say, or ``None`` for files written without them.
        suffixes: which of ``_PPP`` and ``_EEE`` the directory names carry.
    """

    kind = "megatron_legacy"

    def __init__(
        self,
        root: Path,
        tp: int,
        pp: int,
        ep: int = 1,
        suffixes: tuple[bool, bool] | None = None,
        args: MegatronArgs | None = None,
        layers_per_stage: Sequence[int] | None = None,
        chunks: int = 1,
    ) -> None:
        gated = args.swiglu if args is not None else None
        super().__init__(root, tp, pp, "torch", layers_per_stage, ep=ep, gated_mlp=gated)
        self.suffixes = suffixes if suffixes is not None else (pp > 1, ep > 1)
        self.args = args
        self.chunks = chunks
        self._local_experts: dict[int, int] = {}
        self._tied: bool | None = None
        self.header_keys: tuple[str, ...] | None = None  # the first file's entries (open_megatron_legacy)
        self.model_args: Any = None  # the first file's ``args`` as saved (open_megatron_legacy)

    def file_for(self, tp_rank: int, stage: int) -> Path:
        """``root/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``."""
        self._check_coords(tp_rank, stage)
        p, e = self.stage_coords(stage)
        sub = f"mp_rank_{tp_rank:02d}"
        if self.suffixes[0]:
            sub += f"_{p:03d}"
        if self.suffixes[1]:
            sub += f"_{e:03d}"
        return self.root / sub / MEGATRON_FILE

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        obj = safe_torch_load(path)
        if not isinstance(obj, Mapping):
            raise LayoutError(f"'{path}': expected Megatron's checkpoint dict, got {type(obj).__name__}")
        keys = ["model"] if self.chunks == 1 else [f"model{v}" for v in range(self.chunks)]
        missing = [k for k in keys if k not in obj]
        if missing:
            raise LayoutError(f"'{path}' has no {missing} entry; found {sorted(map(str, obj))[:10]}")
        out: dict[str, torch.Tensor] = {}
        for v, key in enumerate(keys):
            model = obj[key]
            if not isinstance(model, Mapping):
                raise LayoutError(f"'{path}': '{key}' is a {type(model).__name__}, not a state dict")
            odd = list(find_stand_ins(model))
            if odd:
                raise LayoutError(
                    f"'{path}': '{key}' holds objects of classes that were not loaded ({', '.join(odd[:5])}); "
                    "they may be weights in a custom format, so the checkpoint is refused rather than "
                    "consolidated without them"
                )
            tensors, skipped = flatten_tensors(model)
            if skipped:
                logger.debug("%s: left out %d non-tensor entries: %s", path, len(skipped), skipped[:10])
            prefix = "" if self.chunks == 1 else f"model{v}/"
            out.update({prefix + name: t for name, t in tensors.items()})
        return out

    def split_chunk(self, local: str) -> tuple[int, str]:
        m = _CHUNK_RE.fullmatch(local)
        return (int(m.group(1)), m.group(2)) if m else (0, local)

    def _experts_on(self, stage: int) -> int:
        """Local experts per MoE layer on a stage (counted on TP rank 0; every EP rank must agree)."""
        if stage not in self._local_experts:
            found: set[int] = set()
            for spec in self.shard_specs(0, stage):
                _, rest = self.split_chunk(spec.name)
                m = _LOCAL_EXPERT_RE.search(rest) or _GROUPED_EXPERT_RE.search(rest)
                if m:
                    found.add(int(m.group(m.lastindex or 1)))
            if found and found != set(range(len(found))):
                raise LayoutError(
                    f"{self.describe_stage(stage)}: local expert indices {sorted(found)} are not 0..n-1"
                )
            self._local_experts[stage] = len(found)
        return self._local_experts[stage]

    def _global_expert_name(self, name: str, stage: int) -> str:
        if self.ep == 1:
            return name
        p, e = self.stage_coords(stage)
        n = self._experts_on(stage)
        first = self._experts_on(p * self.ep)
        if n != first:
            raise LayoutError(
                f"{self.describe_stage(stage)} has {n} local experts per layer, EP rank 0 has {first}"
            )
        if self.args is not None and self.args.num_experts and n * self.ep != self.args.num_experts:
            raise LayoutError(
                f"{self.describe_stage(stage)}: {n} local experts x EP {self.ep} != num_experts "
                f"{self.args.num_experts} in the checkpoint's args"
            )
        name = _LOCAL_EXPERT_RE.sub(lambda m: f"local_experts.{e * n + int(m.group(1))}.", name, count=1)
        return _GROUPED_EXPERT_RE.sub(lambda m: f"{m.group(1)}{e * n + int(m.group(2))}", name, count=1)

    def is_replica(self, local: str, stage: int) -> bool:
        """EP ranks > 0 hold copies of the dense weights; with tied embeddings the last stage's output layer
        is a copy of the first stage's word embeddings."""
        _, rest = self.split_chunk(local)
        p, e = self.stage_coords(stage)
        if e > 0 and not (_LOCAL_EXPERT_RE.search(rest) or _GROUPED_EXPERT_RE.search(rest)):
            return True
        if not (self.pp > 1 and rest == _TIED_COPY and p == self.pp - 1):
            return False
        if self.args is not None and self.args.tied is not None:
            return self.args.tied
        return self._copies_embeddings()

    def _copies_embeddings(self) -> bool:
        """Without args: the last stage's output layer is a tied copy if it equals the first stage's word
        embeddings bit for bit on every TP rank (Megatron keeps the two copies identical)."""
        if self._tied is None:
            same = True
            for t in range(self.tp):
                first = self.load_shard(t, 0).get(_TIED_SOURCE)
                last = self.load_shard(t, (self.pp - 1) * self.ep)[_TIED_COPY]
                same = same and first is not None and bitwise_equal(first, last)
            self._tied = same
            if same:
                logger.info("%s: output_layer.weight equals the word embeddings (tied); left out", self.root)
        return self._tied

    def left_out(self) -> list[tuple[str, str]]:
        """The first file's entries besides its model (``optimizer``, ``rng_state``, ``args``, ...): the
        training state each file holds, not written."""
        keys = self.header_keys if self.header_keys is not None else ()
        model = {"model"} | {f"model{v}" for v in range(self.chunks)}
        return [(k, "training state, not model weights") for k in keys if k not in model]

    def check_args(self) -> None:
        """Checks the layer counts found in the files against ``args.num_layers``."""
        if self.args is None or self.args.num_layers is None:
            return
        found = sum(self.layers_per_stage)
        if found != self.args.num_layers:
            raise LayoutError(
                f"{self.root}: the shards hold {found} decoder layers ({list(self.layers_per_stage)} per "
                f"stage), the checkpoint's args say num_layers={self.args.num_layers}"
            )


@dataclass(frozen=True)
class _Header:
    """What one shard file says of the save it belongs to (``None``: the file does not say)."""

    args: MegatronArgs | None
    chunk_keys: tuple[str, ...]  # its model entries: ``model`` or ``model0``, ``model1``, ...
    keys: tuple[str, ...]  # every entry (model, args, optimizer, rng_state, ...)
    iteration: int | None
    version: float | None  # ``checkpoint_version``
    namespace: Any = None  # the ``args`` as saved (a ``Namespace``): every fact, for a conversion

    def facts(self) -> dict[str, Any]:
        """The facts every shard of one save shares, by the words a message uses."""
        facts: dict[str, Any] = {"iteration": self.iteration, "checkpoint_version": self.version}
        if self.args is not None:
            facts.update(
                {f"args.{k}": v for k, v in vars(self.args).items() if k not in ("swiglu", "tied")},
                swiglu=self.args.swiglu,
                tied_embeddings=self.args.tied,
            )
        facts["model entries"] = list(self.chunk_keys)
        return facts


def _read_header(path: Path) -> _Header:
    """What one file says of its save (its tensors stay mapped, unread)."""
    obj = safe_torch_load(path)
    if not isinstance(obj, Mapping):
        raise LayoutError(f"'{path}': expected Megatron's checkpoint dict, got {type(obj).__name__}")
    args = obj.get("args")
    keys = sorted((k for k in obj if isinstance(k, str) and re.fullmatch(r"model\d*", k)), key=len)
    iteration, version = obj.get("iteration"), obj.get("checkpoint_version")
    return _Header(
        MegatronArgs.from_namespace(args) if args is not None else None,
        tuple(keys),
        tuple(str(k) for k in obj),
        iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None,
        float(version) if isinstance(version, (int, float)) and not isinstance(version, bool) else None,
        args,
    )


def _check_one_save(layout: MegatronLegacyLayout, first: Path, header: _Header) -> None:
    """Every shard file says the same iteration, checkpoint version, args and model entries as the
    first, and the iteration its directory names (``iter_NNNNNNN``), before any tensor is read: a shard
    of another save among them would merge into a wrong model without a word.

    Raises:
        LayoutError: naming both files and what each says."""
    m = _ITER_RE.fullmatch(layout.root.name)
    if m and header.iteration is not None and header.iteration != int(m.group(1)):
        raise LayoutError(
            f"'{first}' says iteration {header.iteration}, but its directory is {layout.root.name}: the "
            "shard was copied from another save; put the files of one save together"
        )
    expected = header.facts()
    for t, s in layout.shards():
        path = layout.file_for(t, s)
        if path == first:
            continue
        facts = _read_header(path).facts()
        differ = [k for k in sorted(expected.keys() | facts.keys()) if facts.get(k) != expected.get(k)]
        if differ:
            said = ", ".join(f"{k} {facts.get(k)!r}" for k in differ)
            other = ", ".join(f"{k} {expected.get(k)!r}" for k in differ)
            raise LayoutError(
                f"the shards are not of one save: '{path}' says {said}; '{first}' says {other}. A consolidation "
                "needs every shard of one save (one iteration of one run); put the files of one save "
                "together"
            )


def open_megatron_legacy(root: Path, layers_per_stage: Sequence[int] | None = None) -> MegatronLegacyLayout:
    """Opens the ``mp_rank_*`` directories under ``root`` (an iteration directory).

    The grid comes from the first file's ``args`` when present, else from the directory names:
    ``TT`` alone is TP; ``TT_NNN`` is TP x PP, unless the files hold experts (then it may be TP x EP, which
    only ``args`` can tell: refused); ``TT_PPP_EEE`` is TP x PP x EP.

    Raises:
        LayoutError: no such directories, a grid that does not add up, or an unsupported split.
        FileNotFoundError: a shard file of the grid is missing.
    """
    found: dict[tuple[int, ...], Path] = {}
    forms: set[int] = set()
    for p in root.iterdir():
        m = _MP_RE.fullmatch(p.name)
        if m and p.is_dir():
            coords = tuple(int(g) for g in m.groups() if g is not None)
            forms.add(len(coords))
            found[coords] = p
    if not found:
        raise LayoutError(f"{root}: no mp_rank_TT[_PPP][_EEE] directories")
    if len(forms) > 1:
        raise LayoutError(
            f"{root}: mixes mp_rank directory forms ({', '.join(sorted(p.name for p in found.values()))})"
        )
    form = forms.pop()
    first = found[min(found)] / MEGATRON_FILE
    if not first.is_file():
        raise FileNotFoundError(f"checkpoint shard '{first}' does not exist")
    header = _read_header(first)
    args, chunk_keys = header.args, list(header.chunk_keys)
    chunks = len(chunk_keys) if chunk_keys and chunk_keys != ["model"] else 1
    sizes = [max(c[i] for c in found) + 1 for i in range(form)]
    if args is not None:
        tp, pp, ep = args.tp, args.pp, args.ep
        expected = 1 + (pp > 1) + (ep > 1)
        if form != expected:
            raise LayoutError(
                f"{root}: args say TP {tp} x PP {pp} x EP {ep}, which Megatron names mp_rank_TT"
                f"{'_PPP' if pp > 1 else ''}{'_EEE' if ep > 1 else ''}, but the directories are "
                f"{sorted(p.name for p in found.values())[:4]}"
            )
        if args.etp not in (None, tp) and ep > 1:
            raise LayoutError(
                f"{root}: expert_tensor_parallel_size {args.etp} differs from tensor_model_parallel_size "
                f"{tp}; Megatron then saves only some TP x EP combinations in the legacy format, which this "
                "tool does not consolidate. Save the checkpoint with --ckpt-format torch_dist and "
                "consolidate that"
            )
        if args.vp and args.vp != chunks:
            raise LayoutError(
                f"{first}: args say {args.vp} virtual pipeline chunks, the file holds {chunk_keys}"
            )
        suffixes = (pp > 1, ep > 1)
    else:
        tp = sizes[0]
        pp = sizes[1] if form >= 2 else 1
        ep = sizes[2] if form == 3 else 1
        suffixes = (form >= 2, form == 3)
    if chunks > 1 and layers_per_stage is not None:
        raise LayoutError(f"{root}: layers_per_stage cannot be given for a virtual-pipeline checkpoint")
    layout = MegatronLegacyLayout(root, tp, pp, ep, suffixes, args, layers_per_stage, chunks)
    layout.check_files()
    _check_one_save(layout, first, header)
    layout.header_keys = header.keys
    layout.model_args = header.namespace
    extra = sorted(set(found) - {_coords(layout, t, s) for t, s in layout.shards()})
    if extra:
        raise LayoutError(
            f"{root}: directories {[found[c].name for c in extra][:4]} lie outside the {layout.describe_grid()} "
            "grid the checkpoint describes"
        )
    if args is None and form == 2 and pp > 1:
        names = [s.name for s in layout.shard_specs(0, 0)]
        if any(_LOCAL_EXPERT_RE.search(n) or _GROUPED_EXPERT_RE.search(n) for n in names):
            raise LayoutError(
                f"{root}: mp_rank_TT_NNN directories of a mixture-of-experts model are TP x PP or TP x EP, "
                "and these files have no args to say which. Give the layout explicitly (a mesh.json), or "
                "consolidate the checkpoint as Megatron saved it (with args)"
            )
    layout.check_args()
    return layout


def _coords(layout: MegatronLegacyLayout, t: int, stage: int) -> tuple[int, ...]:
    p, e = layout.stage_coords(stage)
    return (t, *([p] if layout.suffixes[0] else []), *([e] if layout.suffixes[1] else []))


def _nest(sd: Mapping[str, torch.Tensor], depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in sd.items():
        parts = name.split(".", depth)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = standalone(t)
    return out


def write_megatron_legacy(
    directory: str | os.PathLike[str],
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
    iteration: int | None = None,
    nest_depth: int = 0,
    swiglu: bool | None = False,
) -> MegatronLegacyLayout:
    """Writes TP x PP shards as a Megatron-LM legacy checkpoint (tests, demos, benchmarks).

    ``mp_rank_XX/model_optim_rng.pt`` when PP is 1, else ``mp_rank_XX_YYY/...``; each file holds
    ``{"model": state_dict, "args": Namespace, "checkpoint_version": 3.0, "iteration": N}``, where ``args``
    has the grid, ``swiglu`` and ``untie_embeddings_and_output_weights=True`` (``swiglu=None``: no
    ``args`` at all). With ``iteration``, the shards go under ``iter_NNNNNNN/`` and
    ``latest_checkpointed_iteration.txt`` is written beside it (last).

    Args:
        directory: output directory (created).
        shards: ``{(tp_rank, pp_rank): {local_name: tensor}}`` covering a full grid.
        iteration: training iteration, or ``None`` for a bare ``mp_rank_*`` directory.
        nest_depth: how many leading name components become nested dicts (legacy Megatron nests
            ``language_model`` -> ``encoder`` -> ``layers.0...``); 0 keeps the names flat (Megatron core).
        swiglu: ``args.swiglu`` (the shards' ``linear_fc1`` must then be ``[gate_t; up_t]``); ``None``
            writes no ``args``.
    """
    base = Path(directory)
    root = base if iteration is None else base / f"iter_{iteration:07d}"
    tp, pp = grid_of(shards)
    layout = MegatronLegacyLayout(root, tp, pp)
    args = argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        swiglu=swiglu,
        untie_embeddings_and_output_weights=True,
    )
    for (t, p), sd in shards.items():
        obj: dict[str, Any] = {
            "model": _nest(sd, nest_depth),
            "checkpoint_version": 3.0,
            "iteration": iteration or 0,
        }
        if swiglu is not None:
            obj["args"] = args
        atomic_torch_save(obj, layout.file_for(t, p))
    if iteration is not None:
        atomic_write_text(base / TRACKER_FILE, f"{iteration}\n")
    return layout
