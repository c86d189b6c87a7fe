"""One exception hierarchy for the whole package, all of it defined here.

Every error we raise on purpose derives from :class:`DistributeError`, and also from
the built-in a caller would naturally catch (``ValueError``, ``TimeoutError``, ``OSError``,
``RuntimeError``, ``TypeError``, ``KeyError``, ``IndexError``), so ``except ValueError`` keeps working where a plain
``ValueError`` was raised before. The modules that raise them re-export them under their old
names (``distribute_utils.mailbox.MailboxError``, ``distribute_utils.consolidate.rules.MergeError``, ...).
All of them survive pickling, so a worker's error can be re-raised in its parent. (Private
exceptions that never leave their module, and :class:`~distribute_utils.interrupts.Interrupted`, a
``BaseException`` like ``KeyboardInterrupt``, are not errors in this sense.)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ArgumentError",
    "CheckpointFormatError",
    "ConcurrentUseError",
    "ConsolidationError",
    "ConversionError",
    "CudaError",
    "DeviceUnavailableError",
    "DistributeError",
    "ForkedProcessError",
    "GatherError",
    "LaunchError",
    "LayoutError",
    "MailboxError",
    "MergeError",
    "MisuseError",
    "NotInitializedError",
    "OutOfRangeError",
    "OutputError",
    "PayloadError",
    "PeerLostError",
    "RuleSyntaxError",
    "SpaceError",
    "TransportUnavailableError",
    "UnknownNameError",
    "UnsafeCheckpointError",
    "UnsupportedTypeError",
    "UsageError",
    "WorkspaceError",
    "one_line",
    "plural_list",
    "rebuilt",
]


def one_line(error: BaseException | str) -> str:
    """An error message on one line (what the command line prints and ranks report)."""
    return " ".join(str(error).split())


def plural_list(noun: str, items: Sequence[object]) -> str:
    """``rank 1``, ``ranks 1 and 2``, ``ranks 1, 2 and 3``: a list of things for a message."""
    words = [str(i) for i in items]
    if len(words) == 1:
        return f"{noun} {words[0]}"
    return f"{noun}s {', '.join(words[:-1])} and {words[-1]}"


class DistributeError(Exception):
    """Base of every error raised on purpose by ``distribute_utils``."""


class CudaError(DistributeError, RuntimeError):
    """A CUDA driver call failed (:mod:`.transports.cuda_driver`); the GPU carriers turn it into their own
    errors or fall back, so callers of the gathers do not see it."""


class DeviceUnavailableError(DistributeError, RuntimeError):
    """A received tensor is to be restored on the device its sender had it on, and this process has
    no such device (where ``torch.load`` fails too); the message names the tensor and the device."""


class GatherError(DistributeError, RuntimeError):
    """A gather round failed on some rank (the message names which and why)."""


class ForkedProcessError(DistributeError, RuntimeError):
    """Called in a process forked after its parent joined the default process group: the group's
    connections are the parent's (start the child with spawn, or gather in the parent)."""


class PeerLostError(DistributeError, TimeoutError):
    """Peers did not arrive within the timeout, or their connection broke.

    Attributes:
        missing: global ranks that did not arrive (empty when unknown).
    """

    def __init__(self, message: str, missing: tuple[int, ...] | list[int] = ()) -> None:
        super().__init__(message, tuple(missing))
        self.missing = tuple(missing)

    def __str__(self) -> str:
        return str(self.args[0])


class PayloadError(DistributeError, ValueError):
    """A payload is malformed, truncated, oversized or fails its checksum."""


class SpaceError(DistributeError, OSError):
    """Not enough room in ``/dev/shm`` or the workspace for a payload, or on the output's filesystem for a
    consolidated checkpoint (``errno`` ``ENOSPC``); or a write that made no progress."""


class TransportUnavailableError(DistributeError, ValueError):
    """The requested transport cannot connect these ranks (e.g. ``shm`` across hosts)."""


class WorkspaceError(DistributeError, OSError):
    """The workspace directory cannot be used: missing, not a directory, or not writable."""


class LaunchError(DistributeError, RuntimeError):
    """A spawned local rank failed or died; the message holds its error (the traceback at debug level)."""


class ArgumentError(DistributeError, ValueError):
    """An argument (or ``$DISTRIBUTE_UTILS_TIMEOUT``) is not valid: the message says what is wrong and
    what is valid (ranks lists, transports, timeouts, devices, sizes)."""


class UnsupportedTypeError(DistributeError, TypeError):
    """A value of a type this package cannot take: a config value that cannot travel (named by its path,
    with what is supported), a buffer that is not bytes-like, a tensor gather given no tensor."""


class NotInitializedError(DistributeError, RuntimeError):
    """Something needed was not set up first: ``torch.distributed``'s default process group (the message
    says what to call), or a companion's peer directory."""


class MisuseError(DistributeError, RuntimeError):
    """A call made where or when it cannot work: ``interrupts.install()`` off the main thread or a second
    time, a write to a checkpoint writer that is closed (the message says what to do instead)."""


class UnknownNameError(DistributeError, KeyError):
    """A name that is not there, e.g. a mesh axis name; the message lists the valid names."""

    def __str__(self) -> str:  # the message itself, not KeyError's quoted repr of it
        return str(self.args[0]) if self.args else ""


class OutOfRangeError(DistributeError, IndexError):
    """An index outside its range, e.g. a shard's ``(tp, stage)`` outside the checkpoint's grid; the
    message says the valid range."""


class ConcurrentUseError(DistributeError, RuntimeError):
    """A second thread of a rank entered an operation on a group while another was inside one (operations
    on one group must come from one thread at a time)."""


class MailboxError(DistributeError, OSError):
    """This process cannot listen for a group's messages (its address is taken or not allowed)."""


class OutputError(DistributeError, ValueError):
    """The output path cannot be used as asked (missing parent, not a directory, files in the way)."""


class UsageError(DistributeError, ValueError):
    """``distribute-utils`` arguments that parse but do not make sense together: raised by
    :mod:`.commands`, caught by :mod:`.cli`, which prints the subcommand's usage and exits with code 2."""


# -- consolidation ---------------------------------------------------------------------------------
class LayoutError(DistributeError, ValueError):
    """A checkpoint directory is not a known layout, or its description is inconsistent."""


class CheckpointFormatError(DistributeError, ValueError):
    """A checkpoint file is malformed, or a tensor does not fit the format (dtype, spec)."""


class MergeError(DistributeError, ValueError):
    """Shards of a tensor cannot be merged (shapes, dtypes or contents disagree)."""


class RuleSyntaxError(DistributeError, ValueError):
    """A rule, a rules file or a rules mapping is malformed."""


class ConversionError(DistributeError, ValueError):
    """A checkpoint cannot be converted to the format asked (``--to hf``): a tensor or a fact the converter
    does not know, or a fact it needs that neither the checkpoint nor the caller gives."""


class UnsafeCheckpointError(DistributeError, ValueError):
    """A ``torch.save`` file holds objects that cannot be loaded without running pickled code."""


class ConsolidationError(DistributeError, RuntimeError):
    """The consolidation failed on another rank (or in a spawned local rank), or its output is not what was
    put in (the demo's check).

    Attributes:
        cause: the originating error's message.
        rank: the global rank where it happened (``None`` when unknown).
        kind: the originating exception's type name, e.g. ``"MergeError"``.
    """

    def __init__(self, cause: str, rank: int | None = None, kind: str | None = None) -> None:
        super().__init__(cause, rank, kind)
        self.cause = cause
        self.rank = rank
        self.kind = kind

    def __str__(self) -> str:
        return self.cause if self.rank is None else f"{self.cause} (on rank {self.rank})"


def _ours() -> dict[str, type[Exception]]:
    """Every error class of this module by name (DistributeError and all its subclasses)."""
    found: dict[str, type[Exception]] = {}
    todo: list[type[Exception]] = [DistributeError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


_REBUILT: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError, **_ours()}


def rebuilt(kind: str, message: str, missing: Sequence[int] = ()) -> Exception | None:
    """The error another rank reported, by its type's name ``kind`` and its ``message`` (naming that
    rank), rebuilt as that very type where it is one of this package's (every :class:`DistributeError`
    subclass: the same ``except`` catches it on every rank) or a plain ``TypeError`` / ``ValueError``;
    None for any other type (the caller raises :class:`GatherError` naming it). ``missing``: the ranks
    a :class:`PeerLostError` names."""
    cls = _REBUILT.get(kind)
    if cls is None:
        return None
    if cls is PeerLostError:
        return PeerLostError(message, tuple(missing))
    return cls(message)
