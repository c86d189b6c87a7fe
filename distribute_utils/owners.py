"""Internal. Who owns the package's mutable state: the default process group's scope, or the process's.

A module that keeps state for a group asks for it by class, ``owned(Kind)``, rather than holding it
in a global of its own. :class:`Owner` makes the one instance of ``Kind`` on first use (``Kind()``) and calls its
``close()`` (when it has one) when the owner ends, newest first (state made later may use state made
earlier, never the other way round):

- :func:`owned`: the scope of the current default process group when there is one, else the process
  scope. A group's scope ends when the group is destroyed or replaced, at whichever comes first of:
  its finalizer (when the group object is freed), the first :func:`owned` that finds no default group
  (a job may hold the destroyed group's object for long: a DDP module, a DeviceMesh), and
  :func:`distribute_utils.incarnation.incarnation` or :func:`owned` noticing a new group. So nothing of
  one group is given to the next. A carrier used with no default group (tests, tools) keeps its state
  in the process scope.
- :func:`process_owned`: the process scope, for what cannot belong to a group. It lives as long as
  the process; in a forked child, each of its objects that has a ``forked()`` method is told so
  (it must not use its parent's sockets, segments or threads), and group scopes are forgotten.

In a group's scope: the carriers' segment pool (:mod:`.transports.segment_pool`;
closed, it retires until its busy segments are freed), the first rank's kept maps
(:mod:`.transports.kept_maps`) and the job token (:mod:`.transports.namespace`). Pure-function memos
(wire layouts and heads, rank lists, filesystem uids, scanned checkpoints) are
:class:`~distribute_utils.caches.Recent`, bounded, right for any group. Process-wide state, and why:

- freed reports, the notice socket, lent views, the registry of segment pools (segment_pool,
  kept_maps): reports name processes, not ranks, and reach a sender in a later group's verdict;
  tensors viewing a segment outlive groups;
- CUDA IPC held and unsettled payloads, counts (cuda_ipc): memory a live first rank may still read is
  kept until it exits, whatever group comes;
- CUDA host registrations (pinning): they belong to maps a retiring pool or a tensor still holds;
- NFS workspace rank states, open job namespaces (nfs_workspace, namespace): a process never reuses a
  file name in a namespace (stale NFS attribute caches); namespaces are left at exit or interrupt;
- signal handlers and the interrupt watcher thread (interrupts): signals are the process's;
- the answering thread (mailbox): one socket per process, answering for whichever group is current;
- the watchdog and janitor threads (liveness): the process's, fed by every group's waits;
- the loaded CUDA driver (cuda_driver): a library, loaded once;
- fault points (carriers.inject, mailbox.inject): a test's hook for the process;
- the launcher's temporary folders (launch): removed at exit or interrupt;
- stand-in classes (consolidate.safe_load): one class per pickled global name, equal across loads.

Import-time side effects of the package: this module's one ``os.register_at_fork`` (see above);
every other hook, thread and file is made on first use.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["Owner", "after_fork", "end_group_scope", "group_scope", "owned", "process_owned"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Owner:
    """One instance per class of the state it owns, closed together, newest first."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.closed = False
        self._lock = threading.RLock()  # (a kind's __init__ may own another kind of the same owner)
        self._items: dict[type[Any], Any] = {}

    def own(self, kind: type[T]) -> T:
        """The one ``kind`` of this owner, made (``kind()``) on first use. After :meth:`close`, a new
        one each call, never kept (a late caller of a gone group gets fresh, empty state)."""
        found = self._items.get(kind)
        if found is None:
            with self._lock:
                found = self._items.get(kind)
                if found is None:
                    found = kind()
                    if not self.closed:
                        self._items[kind] = found
        return found  # type: ignore[no-any-return]

    def owns(self, kind: type[Any]) -> bool:
        """Whether a ``kind`` was made here (and not closed yet)."""
        return kind in self._items

    def close(self) -> None:
        """Close every object made here (its ``close()``, if any), newest first; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            items, self._items = list(self._items.values()), {}
        for item in reversed(items):
            close = getattr(item, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    logger.warning("closing %s of %s failed", type(item).__name__, self.what, exc_info=True)

    def forked(self) -> None:
        """In a forked child: tell each object that has a ``forked()`` method."""
        for item in list(self._items.values()):
            forked = getattr(item, "forked", None)
            if forked is not None:
                forked()


_PROCESS = Owner("the process")
# The scope of the current default group (at most one at a time: a new group ends the last one's).
_GROUP: tuple[weakref.ref[dist.ProcessGroup], Owner] | None = None
_GROUP_LOCK = threading.Lock()
_AFTER_FORK: list[Callable[[], None]] = []
_DISTRIBUTED = dist.is_available()  # (whether torch was built with it: fixed for the process)


def group_scope(pg: dist.ProcessGroup) -> Owner:
    """The scope of default group ``pg`` (made on first use; the previous group's scope is closed)."""
    global _GROUP
    current = _GROUP
    if current is not None and current[0]() is pg:
        return current[1]
    with _GROUP_LOCK:
        current = _GROUP
        if current is not None and current[0]() is pg:
            return current[1]
        if current is not None:
            current[1].close()
        scope = Owner(f"process group {id(pg):#x}")
        weakref.finalize(pg, scope.close)  # destroy_process_group() drops the group
        _GROUP = (weakref.ref(pg), scope)
        return scope


def end_group_scope() -> None:
    """Close the last default group's scope now (called by :func:`owned` when it finds no default group:
    the group was destroyed, and the finalizer waits for its object to be freed)."""
    global _GROUP
    with _GROUP_LOCK:
        current, _GROUP = _GROUP, None
        if current is not None:
            current[1].close()


def owned(kind: type[T]) -> T:
    """The one ``kind`` of the current default group's scope, or of the process scope when there is no
    default group (see the module doc)."""
    pg = dist.group.WORLD if _DISTRIBUTED else None  # the default group
    if pg is None:
        if _GROUP is not None:  # destroyed, but its object lives on (a DDP module, a DeviceMesh)
            end_group_scope()
        return _PROCESS.own(kind)
    current = _GROUP
    if current is not None and current[0]() is pg:
        found = current[1]._items.get(kind)  # (Owner.own's first step, without its call: every send asks)
        return found if found is not None else current[1].own(kind)  # type: ignore[no-any-return]
    return group_scope(pg).own(kind)


def process_owned(kind: type[T]) -> T:
    """The one ``kind`` of the process scope (state that cannot belong to a group: see the module doc)."""
    return _PROCESS.own(kind)


def after_fork(hook: Callable[[], None]) -> None:
    """Call ``hook()`` in a forked child, after the process scope's objects were told (modules call it
    at import: it registers nothing with the OS)."""
    _AFTER_FORK.append(hook)


def _forked() -> None:
    global _GROUP, _GROUP_LOCK
    _GROUP, _GROUP_LOCK = None, threading.Lock()  # the parent's group is not this process's to use
    _PROCESS._lock = threading.RLock()
    _PROCESS.forked()
    for hook in _AFTER_FORK:
        hook()


os.register_at_fork(after_in_child=_forked)  # the package's one import-time hook
