"""Internal. Interrupts: SIGINT and SIGTERM end a command at once and leave nothing behind.

A Python signal handler runs only when the main thread gets back to the interpreter, and torch's store
and gloo calls retry on ``EINTR``: a rank waiting for a peer would notice a Ctrl-C only at its timeout,
minutes later. So after :func:`install` the handlers do nothing themselves; the C-level handler writes
the signal to Python's wakeup fd (from whichever thread it runs on) and a watcher thread calls
:func:`end`. ``end`` waits for an :func:`uninterruptible` section in progress, runs the undo actions
registered with :func:`on_interrupt` (newest first), calls the program's ``on_end`` (the CLI prints one
line), and leaves with ``os._exit(128 + signal)``: 130 for SIGINT, 143 for SIGTERM. No other code of the
process runs after that (no ``atexit``, no finalizers), so nothing is written once undoing began.

Who calls what:

1. an entry point (the CLI's ``main``, a spawned rank) calls :func:`install` once, in the main thread,
   and :func:`settle` before it returns (so a return never races an exit in progress);
2. code that creates a temporary creates it and registers its undo inside one :func:`uninterruptible`
   section, so that an interrupt sees either neither or both
   (:class:`distribute_utils.temporaries.Temporaries` does this for files);
3. code that publishes results (renames temporaries to their final names) runs in a section too;
4. code that learns of an interrupt elsewhere (a rank that exited on one) raises :class:`Interrupted`;
   the entry point catches it and calls :func:`end` itself.

Without :func:`install` (library use) signals keep Python's default behaviour; sections and undo
registrations then cost one lock each.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .errors import MisuseError

__all__ = [
    "EXIT_SIGNALS",
    "Interrupted",
    "Undo",
    "end",
    "ending",
    "exit_code",
    "install",
    "on_interrupt",
    "settle",
    "uninterruptible",
]

#: The signals that end a command: Ctrl-C, and what schedulers, ``timeout`` and ``torchrun`` send.
EXIT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)

#: How long :func:`end` waits for a section in progress before undoing anyway (a hung filesystem).
SECTION_WAIT_S = 30.0


def exit_code(signum: int) -> int:
    """The shell's exit status for a process ended by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class Interrupted(BaseException):
    """A signal ended the work (raised where it is learnt of indirectly, e.g. from a rank that exited on one).

    A ``BaseException`` like ``KeyboardInterrupt``: ``except Exception`` does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class Undo:
    """A registered undo action; :meth:`cancel` it once what it undoes is gone or published."""

    __slots__ = ("_action",)

    def __init__(self, action: Callable[[], Any]) -> None:
        self._action: Callable[[], Any] | None = action

    def cancel(self) -> None:
        with _STATE:
            if self._action is not None:
                _UNDO.pop(id(self), None)
                self._action = None

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


_SECTION = threading.RLock()  # held by uninterruptible sections, and by end() while it undoes
_STATE = threading.Lock()  # guards the fields below
_UNDO: dict[int, Undo] = {}
_ENDER: int | None = None  # the thread running end()
_ON_END: Callable[[int], None] | None = None
_INSTALLED: tuple[Any, ...] | None = None  # (read fd, write fd, old wakeup fd, old handlers, thread)


def _park() -> None:
    """Waits for the exit that another thread's :func:`end` is about to make."""
    threading.Event().wait()


def _is_other_ender() -> bool:
    return _ENDER is not None and threading.get_ident() != _ENDER


def ending() -> bool:
    """Whether an interrupt is being handled (the process is about to exit)."""
    return _ENDER is not None


def settle() -> None:
    """Waits here for the exit if another thread is handling an interrupt; returns at once otherwise."""
    if _is_other_ender():
        _park()


@contextlib.contextmanager
def uninterruptible() -> Iterator[None]:
    """A section an interrupt waits for (up to :data:`SECTION_WAIT_S`): creating a temporary together
    with registering its undo, or renaming finished files into place. Keep it to a few file operations."""
    settle()
    with _SECTION:
        settle()
        yield


def on_interrupt(action: Callable[[], Any]) -> Undo:
    """Registers ``action`` to run if the process is interrupted (see the module docstring).

    Returns a handle: :meth:`Undo.cancel` (or leaving it as a context manager) unregisters ``action``.
    Actions must be quick and must tolerate what they undo being gone already.
    """
    settle()
    handle = Undo(action)
    with _STATE:
        _UNDO[id(handle)] = handle
    return handle


def end(signum: int) -> None:
    """Undoes, reports and exits with ``128 + signum``; never returns (see the module docstring)."""
    global _ENDER
    with _STATE:
        already = _ENDER is not None
        if not already:
            _ENDER = threading.get_ident()
    if already:  # an end is in progress (in another thread, or this one re-entered it)
        _park()
    got = _SECTION.acquire(timeout=SECTION_WAIT_S)
    with _STATE:
        actions = [u._action for u in reversed(list(_UNDO.values())) if u._action is not None]
    for action in actions:
        with contextlib.suppress(BaseException):
            action()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if _ON_END is not None:
        with contextlib.suppress(BaseException):
            _ON_END(signum)
    if got:
        _SECTION.release()
    os._exit(exit_code(signum))


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the watcher thread does the work (see the module docstring)."""


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in EXIT_SIGNALS:
                end(signum)


def install(on_end: Callable[[int], None] | None = None) -> Callable[[], None]:
    """Makes SIGINT/SIGTERM end this process through :func:`end`; main thread only, once.

    Args:
        on_end: called with the signal number after undoing, just before the exit (print a line there;
            ``None``: exit silently, as a spawned rank does).

    Returns:
        A function that restores the previous handlers (for entry points called in-process, e.g. tests).

    Raises:
        MisuseError: (a ``RuntimeError``) called off the main thread, or while already installed.
    """
    global _INSTALLED, _ON_END
    if threading.current_thread() is not threading.main_thread():
        raise MisuseError(
            "interrupts.install() must be called from the main thread (signal handlers live there)"
        )
    if _INSTALLED is not None:
        raise MisuseError(
            "interrupts.install() was already called in this process; call the function it returned first to "
            "install again"
        )
    r, w = os.pipe()
    os.set_blocking(w, False)
    os.set_inheritable(r, False)
    os.set_inheritable(w, False)
    _ON_END = on_end
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    old = {s: signal.signal(s, _ignore) for s in EXIT_SIGNALS}
    thread = threading.Thread(target=_watch, args=(r,), name="distribute-utils-interrupts", daemon=True)
    thread.start()
    _INSTALLED = (r, w, old_fd, old, thread)
    return _uninstall


def _uninstall() -> None:
    global _INSTALLED, _ON_END
    if _INSTALLED is None:
        return
    r, w, old_fd, old, thread = _INSTALLED
    for s, handler in old.items():
        signal.signal(s, handler)
    signal.set_wakeup_fd(old_fd)
    os.close(w)  # the watcher reads EOF and ends
    thread.join(timeout=5)
    os.close(r)
    _INSTALLED, _ON_END = None, None
