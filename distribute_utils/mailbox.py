"""Internal. Direct messages between the processes of one host: Unix datagram sockets, no store hop.

A gather whose ranks all run on one host (same kernel, ``/dev/shm``, pid and network namespace)
sends its claims and verdicts through these sockets instead of the job's store: a datagram goes
from one process to the other, where a store request goes through the process that serves the
store and leaves a key to delete later (``docs/performance.md``, "The round without the store").

- A :class:`Mailbox` is one process's socket for one group, bound in this user's private directory
  (:mod:`distribute_utils.host_dir`, mode 0700), named by the process's pid namespace, pid and start
  time and the group's namespace; its file is removed when it closes (at exit at the latest). A
  sender knows the path from the peer's :class:`~distribute_utils.processes.ProcessInfo`. No other
  local user can bind, read or send to a socket there; where that directory is another user's, the
  process does not listen and gathers through the job's store (:func:`answer_inquiries` says so).
- A message is taken only when the kernel says (``SCM_CREDENTIALS``) that it comes from this user
  and from the process the named rank runs as; anything else is dropped.
- A message is ``(call number, sender's rank, kind)`` and bytes. Messages of a later call are kept
  for it (a bounded number); those of an earlier call are dropped (a call that failed).
- A mailbox told to (:meth:`Mailbox.poll`; its group does where the host has a core for every rank of
  the job on it) polls for up to :data:`POLL_S` before a wait sleeps: waking a sleeping process costs
  tens of microseconds, as much as a small gather's own work (an idle core, in a VM a halted virtual
  CPU woken by the host).
- A waiter that waits long can :meth:`~Mailbox.inquire` what a peer does in its call: each process
  answers from a thread of its own (:func:`answer_inquiries`), from what it remembers of its latest
  calls, even while it is busy elsewhere. Nothing is sent or stored for that while all goes well.

Fault injection (tests): :func:`inject` sets one hook per process, called as ``hook(point, what)`` at

- ``"listen"``: before this process binds a socket to listen (``what``: what for, as in the error:
  ``"inquiries"``, ``"direct messages of group <namespace>"``); an ``OSError`` raised there fails it
  as the kernel's refusal would (:class:`MailboxError` "cannot listen for ...", so the process takes
  no part in direct rounds).
- ``"send"``: before a message goes to a peer's mailbox (``what``: its address), through
  :meth:`Mailbox.send_to`, :meth:`Mailbox.send_now`, :meth:`Mailbox.send_each` or a :class:`Line`; an
  ``OSError`` raised there makes that send go as a full queue makes it: nothing is sent, and it says
  False (at once: it does not wait for room).

Call order: one thread at a time per mailbox (a group's calls are; see :mod:`distribute_utils.sync`).
:meth:`Mailbox.send` and :meth:`Mailbox.receive` never wait longer than they are told to.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from . import host_dir
from .caches import Recent
from .errors import MailboxError
from .fault_points import FaultPoint
from .processes import ProcessInfo

__all__ = [
    "ANCILLARY_SIZE",
    "ANSWER",
    "MAX_MESSAGE_BYTES",
    "POLL_S",
    "FaultHook",
    "Line",
    "Mailbox",
    "MailboxError",
    "address",
    "answer_inquiries",
    "inject",
    "sender_pid",
]

logger = logging.getLogger(__name__)

PEERS_KEPT = 64
"""Connected sockets a mailbox keeps for sending, one per peer it sends to (the oldest is closed past it)."""
MAX_MESSAGE_BYTES = 320 * 2**10
"""Largest message (a direct round's claim with its payload attached is at most ~290 KiB); larger ones
must travel another way. Each socket's send buffer is made large enough for it (a datagram must fit
there: Linux's default ``net.core.wmem_max`` allows ~416 KiB)."""
POLL_S = 200e-6
"""How long a wait polls (reads without sleeping, yielding its core to any other runnable task between
tries) before it sleeps, in a mailbox told to (:meth:`Mailbox.poll`). With 2 ranks on 2 cores, the
first rank's time for a gather of 4 KiB to 1 MiB is 0.74-0.86x what it is without (``docs/performance.md``).
It costs at most this much CPU per wait; where processes outnumber cores it would take CPU from them."""
ANSWER = 255
"""The kind of an answer to :meth:`Mailbox.inquire`: ``[entry]``, ``[None]`` or ``["past"]``."""
_INQUIRY = 254
_HEADER = struct.Struct("<qiB")  # call number, sender's rank, kind
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
ANCILLARY_SIZE = socket.CMSG_SPACE(_CREDENTIALS.size)  # room for the sender's credentials
_KEEP = 256  # messages kept for later calls at most
Buffer = bytes | bytearray | memoryview
_MAX_PARTS = 512  # parts of one message handed to the kernel at most (IOV_MAX is 1024 on Linux)
_INQUIRIES = "inquiries"  # the namespace of each process's answering socket
# Plain ints: an operation on the enum members (``flags & socket.MSG_TRUNC``) builds a new member in
# Python code, which costs more than the rest of filing a message.
_NO_WAIT, _TRUNCATED = int(socket.MSG_DONTWAIT), int(socket.MSG_TRUNC)


def address(process: ProcessInfo, namespace: str) -> str:
    """The path of ``process``'s socket for ``namespace`` (:func:`.host_dir.socket_path`): unique on
    the host, since the pid namespace is part of it (simulated nodes or containers share a ``/dev/shm``
    but number their pids alike), and the package's name (a second copy of this package in one
    process, as the benchmark's ``--against`` loads it, has sockets of its own)."""
    return host_dir.socket_path(_name(process, namespace))


def _name(process: ProcessInfo, namespace: str) -> str:
    what = f"{__package__}/{process.pid_namespace}-{process.pid}-{process.start_time}/{namespace}"
    return f"{process.pid}-{hashlib.blake2b(what.encode(), digest_size=12).hexdigest()}"


FaultHook = Callable[[str, str], None]
_FAULTS: FaultPoint[FaultHook] = FaultPoint()


def inject(hook: FaultHook | None) -> FaultHook | None:
    """Call ``hook`` at this process's mailbox fault points (see module doc; None: no hook). Returns
    the hook it replaces, to put back."""
    return _FAULTS.inject(hook)


def _refused(address: str) -> bool:
    """Whether the fault point ``"send"`` refuses a message to ``address`` (its hook raised an ``OSError``)."""
    hook = _FAULTS.hook
    try:
        if hook is not None:
            hook("send", address)
    except OSError:
        return True
    return False


def _socket(process: ProcessInfo, namespace: str, what: str) -> tuple[socket.socket, str]:
    """A socket bound at :func:`address` and its path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        if _FAULTS.hook is not None:
            _FAULTS.hook("listen", what)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_MESSAGE_BYTES)
        room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 1024  # (the kernel's own part)
        if room < MAX_MESSAGE_BYTES + _HEADER.size:  # a datagram must fit in the send buffer
            raise MailboxError(
                f"its send buffer holds {room} bytes, less than {MAX_MESSAGE_BYTES} (net.core.wmem_max)"
            )
        path = host_dir.bind(sock, _name(process, namespace))
    except OSError as exc:
        sock.close()
        raise MailboxError(f"cannot listen for {what}: {exc}") from None
    return sock, path


def sender_pid(ancillary: list[tuple[int, int, bytes]], uid: int) -> int | None:
    """The sending process's pid, as the kernel names it, when it runs as ``uid``; else None."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDENTIALS.size:
            pid, their_uid, _ = _CREDENTIALS.unpack_from(data)
            return pid if their_uid == uid else None
    return None


class Mailbox:
    """This process's socket for one group's messages (``namespace``: the group's store namespace).

    Raises:
        MailboxError: this user's private directory is another user's (see :mod:`.host_dir`), the
            address is taken by a live socket of this user, or sockets are not allowed.
    """

    def __init__(self, namespace: str, me: ProcessInfo) -> None:
        self.namespace, self.me = namespace, me
        self._poll_s = 0.0  # (see poll)
        self._kept: list[
            tuple[int, int, int, int, bytearray]
        ] = []  # later calls' (call, rank, kind, pid, data)
        self._buffer = bytearray(MAX_MESSAGE_BYTES)
        self._buffers = [self._buffer]  # (recvmsg_into's argument, made once)
        self._uid = os.geteuid()
        self._addresses: Recent[tuple[ProcessInfo, str], str] = Recent(4096)
        # (sockets kept connected to the peers this group's messages go to: no path lookup per send)
        self._peers = host_dir.Connections(PEERS_KEPT, 2 * MAX_MESSAGE_BYTES)
        self._sock: socket.socket | None
        self._sock, self.path = _socket(me, namespace, f"direct messages of group {namespace}")
        self._rcvtimeo = 0.0  # SO_RCVTIMEO as set (0: none)
        _hook_process()
        _MAILBOXES.add(self)

    @property
    def polls(self) -> bool:
        """Whether its waits poll for up to :data:`POLL_S` before they sleep (see :meth:`poll`)."""
        return self._poll_s > 0

    def poll(self, on: bool) -> None:
        """From now on, waits poll before they sleep (``on``) or sleep at once (the default)."""
        self._poll_s = POLL_S if on else 0.0

    def close(self, unbind: bool = True) -> None:
        """Stop listening and remove the socket's file (``unbind``: not in a forked child, where the
        file is the parent's)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if unbind:
                host_dir.unbind(self.path)
        self._peers.close()

    def _closed(self) -> MailboxError:
        return MailboxError("this mailbox is closed")

    def _to(self, peer: ProcessInfo, namespace: str) -> str:
        key = (peer, namespace)
        found = self._addresses.get(key)
        if found is None:
            found = self._addresses.put(key, address(peer, namespace))
        return found

    def send(
        self,
        peer: ProcessInfo,
        call: int,
        rank: int,
        kind: int,
        parts: Sequence[Buffer],
        timeout: float = 0.0,
    ) -> bool:
        """Send one message, the concatenation of ``parts`` (gathered by the kernel, not copied here),
        to ``peer``'s mailbox of this group, waiting at most ``timeout`` seconds for room in its queue.

        Returns:
            False when ``peer`` does not listen (yet), or its queue stayed full; True when sent.

        Raises:
            MailboxError: this mailbox is closed, or the message is larger than :data:`MAX_MESSAGE_BYTES`.
        """
        return self.send_to(self._to(peer, self.namespace), call, rank, kind, parts, timeout)

    def address_of(self, peer: ProcessInfo) -> str:
        """``peer``'s mailbox of this group (:func:`address`), for :meth:`send_to`."""
        return self._to(peer, self.namespace)

    def line(self, rank: int, peer_rank: int, peer: ProcessInfo, kind: int, answer: int) -> Line:
        """A kept :class:`Line` from ``rank`` (this process's) to ``peer_rank``, whose process is ``peer``:
        messages of ``kind`` go out, one of ``answer`` is expected back (made by
        :meth:`~distribute_utils.channel.MailboxChannel.claim_line` for a sender's repeat)."""
        return Line(self, rank, peer_rank, peer, kind, answer)

    def send_to(
        self, address: str, call: int, rank: int, kind: int, parts: Sequence[Buffer], timeout: float = 0.0
    ) -> bool:
        """:meth:`send` to the mailbox at ``address`` (:meth:`address_of` the peer; a caller that sends to
        the same peers call after call keeps it)."""
        framed = self._framed(call, rank, kind, parts)
        if _FAULTS.hook is not None and _refused(address):
            return False
        return self._peers.send(address, framed, timeout)

    def send_now(self, address: str, call: int, rank: int, kind: int, parts: Sequence[Buffer]) -> bool:
        """:meth:`send_to`, when the message can go at once through the socket kept connected to ``address``
        (one system call); False otherwise: nothing was sent, and :meth:`send_to` then connects, waits for
        room, or raises what it raises."""
        try:
            framed = self._framed(call, rank, kind, parts)
        except MailboxError:  # (send_to raises it)
            return False
        if _FAULTS.hook is not None and _refused(address):
            return False
        return self._peers.send_now(address, framed)

    def send_each(
        self,
        addresses: Sequence[str],
        call: int,
        rank: int,
        kind: int,
        parts: Sequence[Buffer],
        timeout: float = 0.0,
    ) -> list[int]:
        """:meth:`send_to` one message to each of ``addresses`` (a first rank's verdict to its senders), framed
        once; the positions in ``addresses`` of those not sent to."""
        framed, now, send = self._framed(call, rank, kind, parts), self._peers.send_now, self._peers.send
        hooked = _FAULTS.hook is not None
        return [
            i
            for i, address in enumerate(addresses)
            if (hooked and _refused(address)) or not (now(address, framed) or send(address, framed, timeout))
        ]

    def _framed(self, call: int, rank: int, kind: int, parts: Sequence[Buffer]) -> list[Buffer]:
        """The parts of a message with its header, checked (see :meth:`send`)."""
        size = 0
        for p in parts:  # (a loop: a generator is a call per part, on every claim and verdict)
            size += memoryview(p).nbytes
        if size + _HEADER.size > MAX_MESSAGE_BYTES:
            raise MailboxError(f"a message of {size} bytes is larger than {MAX_MESSAGE_BYTES}")
        if len(parts) > _MAX_PARTS:  # more than the kernel gathers in one call (IOV_MAX): one copy
            parts = [b"".join(parts)]
        if self._sock is None:
            raise self._closed()
        return [_HEADER.pack(call, rank, kind), *parts]

    def inquire(self, peer: ProcessInfo, call: int, rank: int, asking: Any = None) -> bool:
        """Ask ``peer`` (from its answering thread) what it does in call ``call`` of this group; the
        answer comes to this mailbox as a message of kind :data:`ANSWER`. ``asking``: what this rank does
        in that call (msgpack-able; handed to the peer's lookup, which may find that the two disagree).
        False when not sent."""
        question = msgpack.packb([self.namespace, self.me.to_wire(), asking])
        if self._sock is None:
            raise self._closed()
        # By path from this mailbox's own socket: the answer comes back to it.
        parts = [_HEADER.pack(call, rank, _INQUIRY), question]
        return bool(host_dir.send_by(self._sock, parts, (self._to(peer, _INQUIRIES),), 0.0))

    def receive(
        self, call: int, senders: dict[int, ProcessInfo], timeout: float
    ) -> list[tuple[int, int, bytearray]]:
        """Messages ``(rank, kind, data)`` of call ``call`` from ``senders`` (rank -> process) that are
        here or arrive within about ``timeout`` seconds (up to a fifth more): as soon as there is one
        (then one message, or those kept for this call); empty at the time. Each ``data`` is the
        receiver's own writable copy (one copy of the message)."""
        found: list[tuple[int, int, bytearray]] = []
        if self._kept:
            self._take_kept(call, senders, found)
            if found:
                return found
        sock = self._sock
        if sock is None:
            raise self._closed()
        buffers = self._buffers
        deadline = time.monotonic() + timeout
        wait = timeout
        while not found:
            polled = None
            if wait > 0 and self._poll_s:
                polled = self._polled(sock, buffers, min(wait, self._poll_s))
                wait = max(0.0, deadline - time.monotonic())  # (what is left of it after polling)
            if polled is not None:
                size, ancillary, flags = polled
            else:
                # One system call per message: a blocking read bounded by SO_RCVTIMEO, which is set only
                # when the wait asked for differs much from the one set (checked inline: a call saved per read).
                if wait > 0 and not (0.8 * self._rcvtimeo <= wait <= self._rcvtimeo):
                    self._wait_at_most(sock, wait)
                try:
                    size, ancillary, flags, _ = sock.recvmsg_into(
                        buffers, ANCILLARY_SIZE, 0 if wait > 0 else _NO_WAIT
                    )
                except BlockingIOError:  # nothing came in time
                    return found
            self._sort(size, ancillary, flags, call, senders, found)
            wait = deadline - time.monotonic()
            if wait <= 0:
                wait = 0.0  # take what is queued, not waiting
        return found

    def take_next(
        self, call: int, senders: dict[int, ProcessInfo], kind: int, timeout: float
    ) -> tuple[int, bytearray] | None:
        """The next message of call ``call``, as ``(rank, data)``, when it is one of ``kind`` from one of
        ``senders`` (rank -> process, checked as :meth:`receive` checks it) and comes within about ``timeout``
        seconds; None when none came, or the next one is any other (it is then filed as :meth:`receive`
        files it, and one of this call is given first by the next :meth:`receive`). One system call where
        no message is kept and waits sleep: a repeated round's read of the message it expects."""
        if self._kept or self._poll_s:  # (the general way)
            got = self.receive(call, senders, timeout)
            if len(got) == 1 and got[0][1] == kind:
                return got[0][0], got[0][2]
            self.unread(call, got, senders)
            return None
        sock = self._sock
        if sock is None:
            raise self._closed()
        if timeout > 0 and not (0.8 * self._rcvtimeo <= timeout <= self._rcvtimeo):  # (as receive's)
            self._wait_at_most(sock, timeout)
        try:
            size, ancillary, flags, _ = sock.recvmsg_into(
                self._buffers, ANCILLARY_SIZE, 0 if timeout > 0 else _NO_WAIT
            )
        except BlockingIOError:  # nothing came in time
            return None
        if size >= _HEADER.size and not flags & _TRUNCATED:
            their_call, rank, their_kind = _HEADER.unpack_from(self._buffer)
            info = senders.get(rank)
            if (
                their_call == call
                and their_kind == kind
                and info is not None
                and sender_pid(ancillary, self._uid) == info.pid
            ):
                return rank, bytearray(memoryview(self._buffer)[_HEADER.size : size])
        found: list[tuple[int, int, bytearray]] = []
        self._sort(size, ancillary, flags, call, senders, found)
        self.unread(call, found, senders)
        return None

    def _wait_at_most(self, sock: socket.socket, seconds: float) -> None:
        """A blocking read on ``sock`` returns after ``seconds`` at the latest (``SO_RCVTIMEO``). Its callers
        call it only when the wait asked for differs much from the one set (a system call saved per read),
        checking that inline (a Python call saved per read)."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, host_dir.timeval(seconds))
        self._rcvtimeo = seconds

    def unread(
        self, call: int, messages: Sequence[tuple[int, int, bytearray]], senders: dict[int, ProcessInfo]
    ) -> None:
        """Put ``messages`` of call ``call``, as :meth:`receive` gave them (from ``senders``), back: the next
        :meth:`receive` of that call gives them first (a reader that hands its wait over to another)."""
        self._kept[:0] = [(call, r, kind, senders[r].pid, data) for r, kind, data in messages if r in senders]

    @staticmethod
    def _polled(
        sock: socket.socket, buffers: list[bytearray], seconds: float
    ) -> tuple[int, list[tuple[int, int, bytes]], int] | None:
        """A message read within ``seconds`` without sleeping (None: none came); between tries the core
        goes to any other task that is ready to run on it."""
        until = time.monotonic() + seconds
        while True:
            try:
                size, ancillary, flags, _ = sock.recvmsg_into(buffers, ANCILLARY_SIZE, _NO_WAIT)
                return size, ancillary, flags
            except BlockingIOError:
                if time.monotonic() >= until:
                    return None
                os.sched_yield()

    def _sort(
        self,
        size: int,
        ancillary: list[tuple[int, int, bytes]],
        flags: int,
        call: int,
        senders: dict[int, ProcessInfo],
        found: list[tuple[int, int, bytearray]],
    ) -> None:
        """File one received message: this call's into ``found``, a later call's kept, the rest dropped."""
        if size < _HEADER.size or flags & _TRUNCATED:
            return
        their_call, rank, kind = _HEADER.unpack_from(self._buffer)
        if their_call < call:
            return  # a call that ended without it
        pid = sender_pid(ancillary, self._uid)
        if pid is None:
            return
        data = bytearray(memoryview(self._buffer)[_HEADER.size : size])
        if their_call == call:
            info = senders.get(rank)
            if info is not None and info.pid == pid:
                found.append((rank, kind, data))
        elif len(self._kept) < _KEEP:
            self._kept.append((their_call, rank, kind, pid, data))  # checked when its call comes
        else:
            logger.debug("dropped a message for call %d: %d kept already", their_call, _KEEP)

    def _take_kept(
        self, call: int, senders: dict[int, ProcessInfo], found: list[tuple[int, int, bytearray]]
    ) -> None:
        kept, self._kept = self._kept, []
        for message in kept:
            their_call, rank, kind, pid, data = message
            if their_call > call:
                self._kept.append(message)
            elif their_call == call:
                info = senders.get(rank)
                if info is not None and info.pid == pid:
                    found.append((rank, kind, data))


class Line:
    """One peer's way to and from a :class:`Mailbox`, kept by a caller that sends it a message and waits
    for one answer call after call (a repeated round's claim and verdict): :meth:`send` is
    :meth:`Mailbox.send_now` in one Python call (no framing call, no lookup of the kept socket);
    :meth:`hear` reads the answer with :meth:`Mailbox.take_next` and compares it with the one expected.
    Made by :meth:`Mailbox.line`; used from the mailbox's thread (as the mailbox is).

    Call order: :meth:`send`, then, when it sent, :meth:`hear`; when it did not, the caller sends as
    :meth:`Mailbox.send_to` does (nothing went)."""

    __slots__ = ("_answer", "_box", "_kind", "_out", "_path", "_rank", "_senders")

    def __init__(
        self, box: Mailbox, rank: int, peer_rank: int, peer: ProcessInfo, kind: int, answer: int
    ) -> None:
        self._box, self._rank, self._kind, self._answer = box, rank, kind, answer
        self._senders = {peer_rank: peer}
        self._path = box.address_of(peer)
        self._out: socket.socket | None = None  # (the mailbox's socket kept connected to the peer)

    def send(self, call: int, parts: Sequence[Buffer], nbytes: int) -> bool:
        """Send ``parts`` (``nbytes`` in all) as a message of call ``call`` when it can go at once through the
        socket the mailbox keeps connected to the peer; False when it cannot (nothing was sent: the mailbox
        is closed, the message is one :meth:`Mailbox.send_to` refuses or copies, no socket is kept, the
        peer's queue is full or it closed: :meth:`Mailbox.send_to` then does what it does). It checks and
        handles what :meth:`Mailbox.send_now` does, inline: one Python call per message."""
        box = self._box
        if box._sock is None or nbytes + _HEADER.size > MAX_MESSAGE_BYTES or len(parts) >= _MAX_PARTS:
            return False  # (send_to raises or copies)
        out = self._out
        if out is None:
            out = self._out = box._peers.kept(self._path)
            if out is None:
                return False
        if _FAULTS.hook is not None and _refused(self._path):
            return False
        try:
            out.sendmsg([_HEADER.pack(call, self._rank, self._kind), *parts], (), _NO_WAIT)
        except (FileNotFoundError, ConnectionRefusedError):  # (its peer closed: as send_now forgets it)
            self._out = None
            box._peers.forget(self._path)
            return False
        except OSError:  # (its queue is full, or the socket was closed once its mailbox forgot it)
            self._out = None
            return False
        return True

    def hear(self, call: int, expected: Buffer, timeout: float) -> bool:
        """Whether the next message, within about ``timeout`` seconds, is the peer's answer of call ``call``
        and is ``expected`` (read as :meth:`Mailbox.take_next` reads it). Anything else it read is filed as
        :meth:`Mailbox.receive` files it, so that the next :meth:`Mailbox.receive` gives it first."""
        box = self._box
        got = box.take_next(call, self._senders, self._answer, timeout)
        if got is None:
            return False
        if got[1] == expected:
            return True
        box.unread(call, [(got[0], self._answer, got[1])], self._senders)
        return False


# -- answering inquiries -------------------------------------------------------------------------
_MAILBOXES: weakref.WeakSet[Mailbox] = weakref.WeakSet()  # closed in a forked child (see _forked)
_answering_sock: socket.socket | None = None
_answering_path = ""
_answering: threading.Thread | None = None
_answering_lock = threading.Lock()
_closing = False
_hooked = False


def _hook_process() -> None:
    """Registers :func:`_forked` and :func:`_at_exit` once, when this process first has sockets (nothing
    is registered at import; registered twice by a race, each runs twice, harmlessly)."""
    global _hooked
    if not _hooked:
        _hooked = True
        os.register_at_fork(after_in_child=_forked)
        atexit.register(_at_exit)


def _at_exit() -> None:
    """Remove the files of this process's sockets (a process killed outright leaves them to
    :func:`.host_dir.remove_dead_sockets`)."""
    for mailbox in list(_MAILBOXES):
        mailbox.close()
    _stop_answering()


def answer_inquiries(me: ProcessInfo, lookup: Callable[[str, int, int, Any], tuple[int, Any] | None]) -> bool:
    """Answer other processes' :meth:`Mailbox.inquire` from a daemon thread of this process, from
    now on: ``lookup(namespace, call, asker's rank, what the asker does)`` gives this process's rank in
    that group and what it says of that call (None: no such group here, no answer). Idempotent.

    Returns:
        Whether this process listens: one that cannot (sockets not allowed, a small send buffer)
        logs why and must take no part in direct rounds (see :class:`~distribute_utils.sync.GroupSync`).
    """
    global _answering, _answering_sock, _answering_path
    _hook_process()
    with _answering_lock:
        if _answering is not None:
            return _answering.is_alive()
        try:
            sock, _answering_path = _socket(me, _INQUIRIES, "inquiries")
        except MailboxError as exc:
            logger.warning("%s; gathers go through the job's store", exc)
            _answering = threading.Thread()  # not started: nothing to retry
            return False
        _answering_sock = sock
        gone = host_dir.remove_dead_sockets()  # (what processes killed outright left)
        if gone:
            logger.debug("removed %d sockets of processes that died: %s", len(gone), gone)
        _answering = threading.Thread(
            target=_answer, args=(sock, lookup), name="distribute-utils-answers", daemon=True
        )
        _answering.start()
        return True


def _answer(sock: socket.socket, lookup: Callable[[str, int, int, Any], tuple[int, Any] | None]) -> None:
    buffer = bytearray(4096)
    uid = os.geteuid()
    while True:
        try:
            size, ancillary, flags, _ = sock.recvmsg_into([buffer], ANCILLARY_SIZE)
        except OSError:  # closed: the process is exiting
            return
        if _closing:
            return
        pid = sender_pid(ancillary, uid)
        if pid is None or size < _HEADER.size or flags & _TRUNCATED:
            continue
        try:
            call, asker_rank, kind = _HEADER.unpack_from(buffer)
            namespace, asker, asking = msgpack.unpackb(memoryview(buffer)[_HEADER.size : size])
            found = lookup(str(namespace), int(call), int(asker_rank), asking) if kind == _INQUIRY else None
            if found is None:
                continue
            rank, entry = found
            answer = _HEADER.pack(call, rank, ANSWER) + msgpack.packb([entry])
            # Never waits: an asker whose queue is full asks again at its next check.
            sock.sendto(answer, _NO_WAIT, address(ProcessInfo.from_wire(asker), str(namespace)))
        except Exception:  # a malformed inquiry, the asker gone or its queue full: nothing to answer
            logger.debug("could not answer an inquiry", exc_info=True)


def _stop_answering() -> None:
    """At exit: end the answering thread (a shutdown ends its wait) and remove its socket's file."""
    global _closing, _answering_sock
    _closing = True
    sock, _answering_sock = _answering_sock, None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        host_dir.unbind(_answering_path)


def _forked() -> None:
    """A forked child must not read its parent's messages: it closes its copies of the sockets (no
    shutdown, which would end the parent's too; the files stay, they are the parent's) and starts
    without an answering thread."""
    global _answering, _answering_lock, _answering_sock
    for mailbox in list(_MAILBOXES):
        mailbox.close(unbind=False)
    _MAILBOXES.clear()
    if _answering_sock is not None:
        _answering_sock.close()
    _answering, _answering_lock, _answering_sock = None, threading.Lock(), None
