"""One exception hierarchy for the whole package.

Every error we raise on purpose derives from :class:`DistributeError`, and also from
the built-in a caller would naturally catch (``ValueError``, ``TimeoutError``, ...).
All of them survive pickling, so a worker's error can be re-raised in its parent.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "DeviceUnavailableError",
    "DistributeError",
    "ForkedProcessError",
    "GatherError",
    "LaunchError",
    "PayloadError",
    "PeerLostError",
    "SpaceError",
    "TransportUnavailableError",
    "WorkspaceError",
    "one_line",
    "plural_list",
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
    """Not enough room in ``/dev/shm`` or the workspace for a payload."""


class TransportUnavailableError(DistributeError, ValueError):
    """The requested transport cannot connect these ranks (e.g. ``shm`` across hosts)."""


class WorkspaceError(DistributeError, OSError):
    """The workspace directory cannot be used: missing, not a directory, or not writable."""


class LaunchError(DistributeError, RuntimeError):
    """A spawned local rank failed or died; the message holds its error (the traceback at debug level)."""
