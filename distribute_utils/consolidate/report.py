"""Internal. What a consolidation did: :class:`ConsolidationReport` (the same on every rank) and rank 0's peak memory.

Built by the jobs (:mod:`.job`) once the output is published; read by the command line and the demo.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ConsolidationReport", "peak_rss_bytes"]


@dataclass
class ConsolidationReport:
    """What a consolidation did; the same numbers on every rank (rank 0's), except ``rank``.

    Attributes:
        input_dir: the checkpoint read.
        output: the output directory or file given.
        layout: ``"own"`` or ``"megatron_legacy"``.
        tp: tensor-parallel size of the input.
        pp: pipeline-parallel size of the input.
        world_size: ranks that took part (1: consolidated in one process).
        format: output format, ``"safetensors"`` or ``"torch"``.
        tensors: tensors written.
        bytes: tensor bytes written.
        seconds: wall time on rank 0, from entry to the published output.
        transport: how shards travelled (``"shm"``, ``"workspace"``, ..., ``"none"`` in one process).
        rounds: pipeline rounds (batches of the largest stage).
        batch_bytes: merged bytes per stage and round.
        peak_rss_bytes: rank 0's peak resident set (``VmHWM``) at the end, 0 where unknown.
        files: the output files (index last when sharded).
        rank: the rank that returned this report.
        replaced: files of the same names that existed before and were replaced (the command line fills
            it in from its output check, ``--overwrite``); nothing else is ever removed.
        left_out: ``[name, why]`` of what the checkpoint holds and the output does not: training state,
            optimizer entries, values that are not tensors, what ``only`` excluded.
        converted: with ``to="hf"``: ``{"to", "architecture", "renamed", "split", "trimmed", "config"}``
            (how many tensors were renamed; each split and trimmed one; the config written); else None.
    """

    input_dir: str
    output: str
    layout: str
    tp: int
    pp: int
    world_size: int
    format: str
    tensors: int
    bytes: int
    seconds: float
    transport: str
    rounds: int
    batch_bytes: int
    peak_rss_bytes: int
    files: list[str] = field(default_factory=list)
    rank: int = 0
    replaced: list[str] = field(default_factory=list)
    left_out: list[list[str]] = field(default_factory=list)
    converted: dict[str, Any] | None = None

    @property
    def mib_per_s(self) -> float:
        """Throughput in MiB/s (2**20 bytes per second), the unit of every report."""
        return self.bytes / self.seconds / 2**20 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with ``mib_per_s``)."""
        return {**asdict(self), "mib_per_s": self.mib_per_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConsolidationReport:
        """The inverse of :meth:`to_dict`."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self, wall_seconds: float | None = None) -> str:
        """A few human-readable lines (what the CLI prints); ``wall_seconds``: the whole command's time."""
        kind = _LAYOUT_NAMES.get(self.layout, self.layout)
        grid = "" if self.layout in _GLOBAL_LAYOUTS else f", TP {self.tp} x PP {self.pp}"
        files = ", ".join(self.files[:3]) + (f" (+{len(self.files) - 3} more)" if len(self.files) > 3 else "")
        rounds = f"{self.rounds} round{'' if self.rounds == 1 else 's'}"
        lines = [
            f"input:      {self.input_dir}: {kind}{grid}",
            f"ranks:      {self.world_size} (transport: {self.transport}; {rounds} of "
            f"<= {_mib(self.batch_bytes)} per stage)",
            f"written:    {self.tensors} tensors, {_mib(self.bytes)} in {self.seconds:.2f} s "
            f"({self.mib_per_s:.0f} MiB/s), format {self.format}",
            f"rank 0 peak memory (VmHWM): {_mib(self.peak_rss_bytes)}",
            f"output:     {files}",
        ]
        if self.converted:
            c = self.converted
            lines.append(
                f"converted:  to Hugging Face {c['architecture']}: {len(c['renamed'])} renamed, {len(c['split'])} "
                f"split (q/k/v, gate/up), {len(c['trimmed'])} trimmed to vocab_size {c['config']['vocab_size']}"
                "; config.json written"
                + (
                    ""
                    if c["config"].get("eos_token_id") is not None
                    else " (no token ids: give --hf-config eos_token_id=N)"
                )
            )
        if self.left_out:
            lines.append(f"left out:   {_left_out(self.left_out)}")
        if self.replaced:
            lines.append(f"replaced:   {', '.join(self.replaced)} (the older files of these names)")
        if wall_seconds is not None:
            lines.append(f"wall time:  {wall_seconds:.2f} s (the whole command, start-up included)")
        return "\n".join(lines)


_LAYOUT_NAMES = {
    "own": "own (mesh.json)",
    "megatron_legacy": "Megatron-LM legacy",
    "megatron_torch_dist": "Megatron torch_dist (DCP)",
    "dcp": "torch.distributed.checkpoint",
}
_GLOBAL_LAYOUTS = ("megatron_torch_dist", "dcp")


def _left_out(entries: list[list[str]]) -> str:
    """``N entries: 3 not a tensor (train_state.step, ...); 12 ...`` (all of them in ``--json``)."""
    by_why: dict[str, list[str]] = {}
    for name, why in entries:
        by_why.setdefault(why, []).append(name)
    parts = [
        f"{len(names)} {why} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        for why, names in by_why.items()
    ]
    return f"{len(entries)} entries not written: " + "; ".join(parts) + " (every name: --json)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _proc_status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM`` of ``/proc/self/status``), 0 where unknown."""
    return _proc_status_bytes("VmHWM")
