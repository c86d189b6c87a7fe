"""Waiting for a peer without taking the CPU from it when the answer comes.

A sender blocks for its first rank's verdict. When the verdict comes, the first rank still has
the other senders to answer and its own result to return: the job waits for it, not for the
sender. Woken as usual on a busy machine (more ranks than cores, or other jobs), the sender
preempts the first rank, which then finishes a time slice later. So while it waits, a sender's
thread runs as ``SCHED_BATCH``: the kernel never preempts a running task to wake it (on an idle
core it still runs at once). Its nice value is kept, and its policy is given back as it was.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["BehindPeers"]

_OTHER = getattr(os, "SCHED_OTHER", None)
_BATCH = getattr(os, "SCHED_BATCH", None)
_PARAM = os.sched_param(0) if _BATCH is not None else None


class BehindPeers:
    """``with BehindPeers():`` the calling thread is ``SCHED_BATCH`` inside, when it was ``SCHED_OTHER``
    (any other policy, one the thread may not leave, or a platform without them: left alone)."""

    __slots__ = ("_switched",)

    def __enter__(self) -> BehindPeers:
        self._switched = False
        if _BATCH is not None:
            with contextlib.suppress(OSError):
                if os.sched_getscheduler(0) == _OTHER:
                    os.sched_setscheduler(0, _BATCH, _PARAM)
                    self._switched = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._switched:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, _OTHER, _PARAM)  # type: ignore[arg-type]
