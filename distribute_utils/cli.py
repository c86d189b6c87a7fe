"""The ``distribute-utils`` command line: ``demo``, ``consolidate``, ``doctor``, ``clean``.

``main(argv) -> int`` parses (:func:`build_parser`), configures logging, handles interrupts and
dispatches to the command's implementation in :mod:`.commands`. Exit codes: 0 ok, 1 failure (a
one-line cause on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import logging
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from . import __version__, interrupts
from .commands import cmd_clean, cmd_consolidate, cmd_demo, cmd_doctor, fail
from .errors import LaunchError, UsageError

__all__ = ["main"]

logger = logging.getLogger("distribute_utils.cli")


# -- argument types --------------------------------------------------------------------------------
def _size_arg(text: str) -> int:
    from .consolidate.writers import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


# -- plumbing --------------------------------------------------------------------------------------
_CONSOLIDATE_EPILOG = """\
input layouts (detected):
  own                mesh.json + one file per rank (safetensors or torch.save), see docs/consolidation.md
  Megatron-LM legacy mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt (TP, PP, expert-parallel), model or
                     model0, model1, ... (virtual pipeline); args in the files say how the model was split
  Megatron torch_dist / torch DCP   .metadata + *.distcp: streamed in one process, never all in memory
  (the last two optionally under iter_NNNNNNN/ named by latest_checkpointed_iteration.txt)

ranks:
  Not under torchrun: one process streams every shard (memory-mapped; on one host faster and smaller than
  ranks, see docs/performance.md); --nproc TPxPP(xEP) spawns one local rank per shard (gloo, /dev/shm).
  A DCP checkpoint always runs in one process.
  Under torchrun: start exactly TP x PP (x EP) ranks; rank (stage, tp) = stage * TP + tp reads its shard.

merge rules (built-in, Megatron names): column-parallel weights/biases concat:0 (a gated MLP's linear_fc1:
  swiglu, from args or --swiglu), row-parallel weights concat:1, norms/routers/position embeddings same;
  any other tensor split across TP ranks is an error naming it. --rules FILE adds patterns first; its
  catch-all ('* RULE') comes after the built-in rules and decides only what they do not name.

exit codes:
  0  ok; the report goes to stdout (--json for JSON)
  1  failure: one-line cause on stderr (a missing shard file, tensors that cannot be merged, a full disk,
     a rank that died); no partial output file is left
  2  usage error: bad options or --max-shard-size, --nproc not TP x PP (or 1), INPUT not a checkpoint
  130, 143  interrupted (SIGINT, SIGTERM; to this process, a rank or the group): every process it started
     ends, its temporary files are removed, one line on stderr; after `kill -9`, `distribute-utils clean`
     removes what it left

examples:
  distribute-utils consolidate ckpt/ out/
  distribute-utils consolidate ckpt/iter_0001200 out/ --max-shard-size 5GB --quant-format fp8
  torchrun --nproc-per-node 4 -m distribute_utils consolidate ckpt/ out/
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, with where the help is (not the usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``distribute-utils`` (all subcommands)."""
    parser = _Parser(
        prog="distribute-utils",
        description="Gather configs and tensor shards to one rank at the end of a distributed PyTorch job, "
        "and consolidate tensor/pipeline-parallel checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars, warnings and errors only"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="run the built-in end-to-end demo on local processes",
        description="Start N local ranks (gloo, shared memory). Part 1: build a TP x PP mesh, create its "
        "groups, run a collective and a barrier per axis. Part 2: shard a synthetic GPT-like model TP x PP "
        "into a temporary directory, consolidate it on the same ranks with the code path of `consolidate`, "
        "verify every tensor bit for bit against the unsharded original, and print a short report.",
        epilog="Exit codes: 0 ok, 1 failure (one-line cause on stderr), 2 usage error.",
    )
    demo.add_argument("--nproc", type=int, default=4, help="number of local ranks (default 4)")
    demo.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    demo.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    demo.add_argument(
        "--size-mb",
        type=float,
        default=64.0,
        metavar="M",
        help="approximate size of the synthetic model in MB (default 64)",
    )
    demo.add_argument(
        "--keep",
        metavar="DIR",
        default=None,
        help="keep the sharded checkpoint (DIR/checkpoint) and the output (DIR/consolidated) instead of "
        "removing a temporary directory; both must be new or empty unless --overwrite",
    )
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="with --keep: replace the files of DIR/checkpoint and DIR/consolidated that the demo writes "
        "(nothing else is removed)",
    )
    demo.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        default=argparse.SUPPRESS,
        help="the report only: no progress lines on stderr",
    )
    demo.set_defaults(handler=cmd_demo)

    cons = sub.add_parser(
        "consolidate",
        help="merge a TP x PP sharded checkpoint into one checkpoint",
        description=textwrap.fill(
            "Merge a tensor-parallel x pipeline-parallel checkpoint into one safetensors (or torch.save) "
            "checkpoint, written tensor by tensor (layers renumbered), so that the model is never held in "
            "memory. By default this one process does it, streaming every shard (memory-mapped). --nproc "
            "TPxPP spawns one local rank per shard (gloo, shared memory): each rank reads only its own "
            "shard, each TP group gathers its shards to its first rank, which merges them by rule, and the "
            "stages send their tensors to rank 0, which writes each one as it arrives. Started under "
            "torchrun, this process is one rank of such a job.",
            width=100,
        ),
        epilog=_CONSOLIDATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cons.add_argument("input", metavar="INPUT", help="the sharded checkpoint directory")
    cons.add_argument(
        "output",
        metavar="OUTPUT",
        help="output directory (files model.safetensors or model-0000k-of-0000N.safetensors + index; "
        "pytorch_model*.bin for --format torch), or a file path ending in .safetensors / .bin",
    )
    cons.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="output format (default safetensors; torch holds each output file in memory until complete)",
    )
    cons.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="1 (the default): consolidate in this process, streaming every shard; or TP x PP (x EP) of "
        "the input: spawn one local rank per shard; under torchrun it must match the world size",
    )
    cons.add_argument(
        "--workspace",
        metavar="DIR",
        default=None,
        help="a directory every rank can reach (NFS), used between hosts (default: none; on one host "
        "shards travel through /dev/shm)",
    )
    cons.add_argument(
        "--rules",
        metavar="FILE",
        default=None,
        help="merge rules file (lines 'PATTERN RULE', first match wins), tried before the built-in "
        "Megatron rules, except a catch-all line ('* RULE'), which is tried after them: it decides only "
        "tensors no other rule names (default: built-in rules only)",
    )
    cons.add_argument(
        "--quant-format",
        choices=("fp8", "int8_sq", "int4_awq"),
        default=None,
        help="add the built-in rules for ModelOpt quantization scales of this format (default: none)",
    )
    cons.add_argument(
        "--swiglu",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the MLP is gated (linear_fc1 holds [gate; up] on every TP rank) or not; default: as the "
        "checkpoint's args say (Megatron's --swiglu); a split linear_fc1 without either is an error",
    )
    cons.add_argument(
        "--megatron-names",
        choices=("te", "local"),
        default=None,
        help="torch_dist only: layer-norm names as a TransformerEngine model has them "
        "(self_attention.linear_qkv.layer_norm_weight) or as --transformer-impl local has them "
        "(input_layernorm.weight); default: the checkpoint's args.transformer_impl, else te",
    )
    cons.add_argument(
        "--to",
        choices=("hf",),  # (hf_llama.HF_TARGETS: the parser imports no torch)
        default=None,
        help="hf: write a Hugging Face transformers checkpoint (LlamaForCausalLM: config.json, safetensors "
        "with Llama's names, q/k/v and gate/up split) from a Megatron GPT checkpoint of the Llama family; "
        "anything else is refused, naming the tensor or fact (default: the merged tensors, own names)",
    )
    cons.add_argument(
        "--hf-config",
        metavar="KEY=VALUE",
        action="append",
        default=None,
        help="with --to hf: a config.json fact the checkpoint lacks or the tokenizer's (VALUE read as JSON): "
        "hidden_act, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta, rope_scaling, "
        "max_position_embeddings, vocab_size, tie_word_embeddings, bos_token_id, eos_token_id, pad_token_id; "
        "vocab_size trims Megatron's padded vocabulary; repeatable",
    )
    cons.add_argument(
        "--only",
        metavar="PREFIX",
        default=None,
        help="write only the tensors whose names start with PREFIX, e.g. model. (a DCP checkpoint's model, "
        "not its optimizer state); the rest is listed in the report as left out",
    )
    cons.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        default=None,
        help="remove PREFIX from the start of every name written, e.g. model. (so that the output loads "
        "into the bare module)",
    )
    cons.add_argument(
        "--max-shard-size",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="split the output into files of at most SIZE tensor bytes, e.g. 5GB or 500MiB, with a Hugging "
        "Face index json (default: one file)",
    )
    cons.add_argument(
        "--timeout",
        type=_seconds_arg,
        default=None,
        metavar="S",
        help="seconds any rank waits for another before failing (default $DISTRIBUTE_UTILS_TIMEOUT or 600)",
    )
    cons.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress bar, warnings and errors only",
    )
    cons.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the files of OUTPUT that this run writes (the same names: model.safetensors, or "
        "model-0000k-of-0000N.safetensors + index, or the file named), each once the new one is complete; "
        "nothing else is ever removed. Without it such files are refused, named; files of the same naming "
        "scheme that this run would not write (another split) are always refused, named; other files are "
        "left alone",
    )
    cons.add_argument(
        "--dry-run",
        action="store_true",
        help="print each output tensor's merge rule, dtype and shape, and the output size; write nothing",
    )
    cons.add_argument("--json", action="store_true", help="print the report (or the error) as JSON")
    cons.set_defaults(handler=cmd_consolidate)

    doctor = sub.add_parser(
        "doctor",
        help="check this host (and a workspace) for what would make a gather fail",
        description="Print /dev/shm size and free space, segments left by jobs (owner pid, alive or dead), "
        "temporary output files of killed consolidations, workspace namespaces (owners, alive/dead/remote, age), torch and backend versions, whether the "
        "workspace is writable and how long a small write+read round trip takes there.",
        epilog="Exit codes: 0 nothing would make a gather fail; 1 a problem was found (each is named). "
        "Leftovers of dead jobs are reported, not failures: remove them with `distribute-utils clean`.",
    )
    doctor.add_argument("--workspace", metavar="DIR", help="the shared workspace directory to check")
    doctor.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    doctor.set_defaults(handler=cmd_doctor)

    clean = sub.add_parser(
        "clean",
        help="remove what dead jobs left in /dev/shm and in a workspace",
        description="Remove segments whose owner process has exited (this host, this pid namespace), "
        "temporary output files of consolidations that were killed (recorded in /dev/shm), and workspace "
        "namespaces whose owners are all dead (or, for owners on other hosts, untouched for 24 h). "
        "A live job's files are never touched.",
        epilog="Exit codes: 0 ok; 1 something could not be removed or the workspace is unusable.",
    )
    clean.add_argument("--workspace", metavar="DIR", help="also sweep this shared workspace directory")
    clean.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    clean.add_argument("--json", action="store_true", help="print what was removed as one JSON object")
    clean.set_defaults(handler=cmd_clean)
    return parser


def _configure_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet or verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def _seconds_since_start() -> float:
    """How long ago this process started, by the kernel's count (0 where ``/proc`` cannot tell): the
    reported wall time then includes the interpreter's start and the imports, as ``time`` measures."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``distribute-utils``; returns the exit code.

    As the command (``argv`` is ``None``: the console script, ``python -m distribute_utils``) it exits
    the process itself once the command is done: exit handlers run and output is flushed, but the
    interpreter's teardown of torch (about 0.5 s) is skipped, so the reported wall time is what the
    shell's ``time`` measures."""
    code = _main(argv)
    if argv is None:
        atexit._run_exitfuncs()  # logging, multiprocessing's temporary folder, workspace namespaces
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
                stream.flush()
        os._exit(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    started = time.perf_counter() - _seconds_since_start()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.started = started
    args.target = None  # the OutputTarget, once the command has one
    _configure_logging(args.verbose, args.quiet)
    restore = _handle_interrupts(args)
    try:
        return int(args.handler(args))
    except interrupts.Interrupted as exc:  # a rank was interrupted: the command is too
        interrupts.end(exc.signum)
    except UsageError as exc:
        fail(args, exc, code=2)
        subparser = _subparsers_of(parser).get(args.command, parser)
        subparser.error(str(exc))  # one line and where help is; exits with code 2
    except (LaunchError, OSError, ValueError, RuntimeError) as exc:
        fail(args, exc)
        return 1
    finally:
        interrupts.settle()
        restore()
    return 0


def _handle_interrupts(args: argparse.Namespace) -> Callable[[], None]:
    """SIGINT/SIGTERM end the command through :mod:`.interrupts` (undo, one line, exit 130/143).

    Returns the function that restores the previous handlers (a no-op off the main thread)."""
    try:
        return interrupts.install(functools.partial(_say_interrupted, args))
    except RuntimeError:  # not the main thread, or already installed by a caller
        return lambda: None


def _say_interrupted(args: argparse.Namespace, signum: int) -> None:
    """The one line an interrupted command prints (stderr; with ``--json`` also the error object).

    Runs in the interrupt watcher while the main thread may still run: each step is guarded, so that a
    failing one cannot swallow the line."""
    what = "stopped"
    if args.command in ("consolidate", "demo"):
        what = "nothing written"
        target = args.target
        try:
            if target is not None and target.written_since():
                what = f"the output in '{target.directory}' was already complete"
        except Exception:
            logger.debug("could not look at the output", exc_info=True)
    # Over a half-drawn bar (this process's, or one its ranks drew on the same stderr); bars are drawn
    # only on a terminal.
    clear = "\r\x1b[2K" if sys.stderr.isatty() else ""
    os.write(2, f"{clear}distribute-utils {args.command}: interrupted; {what}\n".encode())
    if getattr(args, "json", False):
        error = {
            "error": f"interrupted; {what}",
            "kind": "Interrupted",
            "exit_code": interrupts.exit_code(signum),
        }
        os.write(1, (json.dumps(error) + "\n").encode())


def _subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
