"""Direct messages between processes of one host (distribute_utils.mailbox), with real processes."""

from __future__ import annotations

import errno
import io
import os
import pickle
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from distribute_utils import host_dir, hygiene
from distribute_utils.mailbox import (
    ANSWER,
    MAX_MESSAGE_BYTES,
    Mailbox,
    MailboxError,
    address,
    answer_inquiries,
    inject,
)
from distribute_utils.processes import ProcessInfo, this_process

NS = f"test-mailbox/{os.getpid()}"


def _in_child(body: Callable[[int], None]) -> tuple[int, ProcessInfo]:
    """Fork a child that runs ``body(write_fd)``; it first writes its ProcessInfo to the parent."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(read)
            body(write)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(read, 4096)
        if not chunk:
            break
        data += chunk
    os.close(read)
    return pid, pickle.loads(bytes.fromhex(data.decode().strip()))


def _announce(fd: int) -> None:
    os.write(fd, pickle.dumps(this_process()).hex().encode() + b"\n")


def _reap(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _sender(messages: list[tuple[int, int, bytes]], uid: int | None = None) -> Callable[[int], None]:
    def body(fd: int) -> None:
        if uid is not None:
            os.setuid(uid)
        parent = pickle.loads(bytes.fromhex(os.environ["PARENT_INFO"]))
        box = Mailbox(NS, this_process())
        _announce(fd)
        for call, kind, data in messages:  # sent in parts (gathered by the kernel), except tiny ones
            parts = [data[:7], memoryview(data)[7:]] if len(data) > 7 else [data]
            assert box.send(parent, call, 1, kind, parts, timeout=5)
        time.sleep(0.2)  # let the parent read before this socket goes

    return body


@pytest.fixture
def parent_box(monkeypatch: pytest.MonkeyPatch) -> Any:
    me = this_process()
    box = Mailbox(NS, me)
    monkeypatch.setenv("PARENT_INFO", pickle.dumps(me).hex())
    yield box
    box.close()


def _queued(box: Mailbox, call: int, senders: dict[int, ProcessInfo]) -> list[Any]:
    """Every message of ``call`` from ``senders`` already queued (the sender has exited)."""
    found: list[Any] = []
    while got := box.receive(call, senders, 0.0):
        found += got
    return found


def _receive_all(box: Mailbox, call: int, senders: dict[int, ProcessInfo], want: int) -> list[Any]:
    found: list[Any] = []
    deadline = time.monotonic() + 10
    while len(found) < want and time.monotonic() < deadline:
        found += box.receive(call, senders, 0.5)
    return found


def test_messages_of_this_call_come_in_order_a_later_call_is_kept_an_earlier_dropped(
    parent_box: Mailbox,
) -> None:
    largest = os.urandom(MAX_MESSAGE_BYTES - 64)  # a direct round's largest inline claim fits
    pid, child = _in_child(_sender([(3, 0, b"old"), (5, 0, b"a"), (7, 1, b"later"), (5, 1, largest)]))
    try:
        assert _receive_all(parent_box, 5, {1: child}, 2) == [(1, 0, b"a"), (1, 1, largest)]
        # the call-7 message came while call 5 was read: kept for call 7; call 3's was dropped
        assert parent_box.receive(7, {1: child}, 0.0) == [(1, 1, b"later")]
        assert parent_box.receive(3, {1: child}, 0.0) == []
    finally:
        assert _reap(pid) == 0


def test_a_message_is_taken_only_from_the_process_the_rank_runs_as(parent_box: Mailbox) -> None:
    """The kernel names the sender (SCM_CREDENTIALS): a process that says it is rank 1 but is not
    the process rank 1 runs as is ignored, whatever it writes in the message."""
    pid, child = _in_child(_sender([(5, 0, b"forged"), (5, 1, b"forged")]))
    impostor_of = ProcessInfo(**{**child.__dict__, "pid": child.pid + 100_000})
    assert _reap(pid) == 0  # it sent both before it exited
    assert _queued(parent_box, 5, {1: impostor_of}) == []


def test_take_next_takes_the_message_it_expects_and_files_any_other_as_receive_does(
    parent_box: Mailbox,
) -> None:
    """A repeated round's read (``take_next``): the next message when it is of the call, kind and process
    asked for; anything else is filed as ``receive`` files it (this call's for the next ``receive``, a later
    call's kept, an earlier one's or an impostor's dropped) and it says None."""
    pid, child = _in_child(
        _sender([(5, 0, b"claim"), (7, 0, b"later"), (5, 1, b"another kind"), (3, 0, b"old"), (5, 0, b"x")])
    )
    assert _reap(pid) == 0  # (all of them queued)
    senders = {1: child}
    impostor = {1: ProcessInfo(**{**child.__dict__, "pid": child.pid + 100_000})}
    assert parent_box.take_next(5, senders, 0, 0.0) == (1, b"claim")
    assert parent_box.take_next(5, senders, 0, 0.0) is None  # call 7's: kept for it
    assert parent_box.take_next(5, senders, 0, 0.0) is None  # another kind: given by the next receive
    assert parent_box.receive(5, senders, 0.0) == [(1, 1, b"another kind")]
    assert parent_box.receive(7, senders, 0.0) == [(1, 0, b"later")]
    assert parent_box.take_next(5, senders, 0, 0.0) is None  # call 3's: dropped
    assert parent_box.take_next(5, impostor, 0, 0.0) is None  # not from the process rank 1 runs as: dropped
    assert parent_box.take_next(5, senders, 0, 0.0) is None  # nothing left, and nothing waited for
    assert _queued(parent_box, 5, senders) == []


def test_take_next_reads_the_socket_only_when_nothing_is_kept_and_waits_at_most_its_timeout(
    parent_box: Mailbox,
) -> None:
    """Its one-read path: a message of another kind is filed for the next ``receive`` (nothing kept before
    it); a message kept for this call comes before the socket's; a read of an empty socket returns after
    about its timeout, whatever wait was set before (a bounded read, not a blocking one)."""
    pid, child = _in_child(_sender([(5, 1, b"another kind"), (5, 0, b"A"), (5, 0, b"B"), (5, 0, b"C")]))
    assert _reap(pid) == 0
    senders = {1: child}
    assert parent_box.take_next(5, senders, 0, 0.0) is None  # (read from the socket: nothing was kept)
    assert parent_box.receive(5, senders, 0.0) == [(1, 1, b"another kind")]
    assert parent_box.take_next(5, senders, 0, 0.0) == (1, b"A")
    got = parent_box.receive(5, senders, 0.0)
    assert got == [(1, 0, b"B")]
    parent_box.unread(5, got, senders)  # (a reader that hands its wait over puts it back)
    assert parent_box.take_next(5, senders, 0, 0.0) == (1, b"B")  # the kept one, not the socket's C
    assert parent_box.take_next(5, senders, 0, 0.0) == (1, b"C")
    for wait in (30.0, 0.2):  # (a long wait set first: the short one must replace it)
        outcome: list[Any] = []

        def read(into: list[Any] = outcome, seconds: float = wait) -> None:
            into.append(parent_box.take_next(5, senders, 0, seconds))

        reader = threading.Thread(target=read)
        start = time.monotonic()
        if wait > 1:
            parent_box.send_to(parent_box.path, 5, 1, 0, [b"to end the long wait"])
        reader.start()
        reader.join(10)
        assert not reader.is_alive() and len(outcome) == 1, f"take_next({wait}) did not return"
        if wait < 1:
            assert outcome == [None] and time.monotonic() - start < 5


def test_send_now_goes_only_through_a_kept_socket_and_sends_nothing_send_to_would_refuse(
    parent_box: Mailbox,
) -> None:
    """``send_now`` (one system call, no wait): False, nothing sent, where there is no connected socket yet
    or the message is one ``send_to`` refuses (larger than :data:`MAX_MESSAGE_BYTES`)."""
    me, here = {1: this_process()}, parent_box.path
    assert parent_box.send_now(here, 8, 1, 0, [b"none kept yet"]) is False
    assert parent_box.send_to(here, 5, 1, 0, [b"x"])  # (connects, and keeps the socket)
    assert parent_box.send_now(here, 6, 1, 0, [b"y", memoryview(b"z")]) is True
    assert parent_box.send_now(here, 9, 1, 0, [bytes(MAX_MESSAGE_BYTES)]) is False
    with pytest.raises(MailboxError, match="larger than"):
        parent_box.send_to(here, 9, 1, 0, [bytes(MAX_MESSAGE_BYTES)])
    assert parent_box.receive(5, me, 0.0) == [(1, 0, b"x")]
    assert parent_box.receive(6, me, 0.0) == [(1, 0, b"yz")]
    # (calls 8 and 9 are later: a message of theirs would have been kept while 5 and 6 were read)
    assert _queued(parent_box, 8, me) == [] and _queued(parent_box, 9, me) == []
    sent = 0  # a full queue: True exactly for the messages that went
    while parent_box.send_now(here, 10, 1, 0, [bytes(1000)]):
        sent += 1
        assert sent < 10_000, "the queue never filled"
    assert sent > 0 and len(_queued(parent_box, 10, me)) == sent


def test_a_line_sends_through_the_kept_socket_and_hears_only_the_answer_it_expects(
    parent_box: Mailbox,
) -> None:
    """A repeated round's line (``Mailbox.line``): ``send`` goes only through the socket kept connected to the
    peer, at once, and sends nothing ``send_to`` would refuse; ``hear`` is True only for the peer's answer of
    the call with the bytes expected, and files anything else as ``receive`` does."""
    me, here = {1: this_process()}, parent_box.path
    line = parent_box.line(
        1, 1, this_process(), 0, 1
    )  # (this process as rank 1, to itself: claims out, kind 1 back)
    assert line.send(4, [b"none kept yet"], 13) is False
    assert parent_box.send_to(here, 5, 1, 0, [b"x"])  # (connects, and keeps the socket)
    assert line.send(5, [b"cl", memoryview(b"aim")], 5) is True
    assert line.send(9, [bytes(MAX_MESSAGE_BYTES)], MAX_MESSAGE_BYTES) is False
    assert _queued(parent_box, 5, me) == [(1, 0, b"x"), (1, 0, b"claim")]
    assert _queued(parent_box, 4, me) == [] and _queued(parent_box, 9, me) == []
    for call, kind, data in [(5, 1, b"success"), (5, 1, b"a failure"), (5, 0, b"a claim"), (7, 1, b"later")]:
        assert parent_box.send_to(here, call, 1, kind, [data])
    assert line.hear(5, b"success", 0.0) is True
    assert line.hear(5, b"success", 0.0) is False  # another verdict: for the next receive
    assert parent_box.receive(5, me, 0.0) == [(1, 1, b"a failure")]
    assert line.hear(5, b"success", 0.0) is False  # another kind
    assert parent_box.receive(5, me, 0.0) == [(1, 0, b"a claim")]
    assert line.hear(5, b"success", 0.0) is False  # a later call's: kept for it
    assert parent_box.receive(7, me, 0.0) == [(1, 1, b"later")]
    assert line.hear(5, b"success", 0.0) is False  # nothing came
    assert parent_box.send_to(here, 6, 1, 1, [b"success"])
    assert line.hear(6, b"success", 0.0) is True  # (the general read, with nothing kept: the same answer)
    assert (
        line.send(10, [b"p"] * 512, 512) is False
    )  # (more parts than the kernel gathers: send_to copies them)
    assert _queued(parent_box, 10, me) == []
    parent_box.close()
    assert line.send(11, [b"after close"], 11) is False  # (send_to says the mailbox is closed)


def test_the_send_fault_point_makes_a_send_to_an_address_go_as_a_full_queue_makes_it(
    parent_box: Mailbox,
) -> None:
    """A hook at the fault point ``"send"`` that raises an ``OSError`` for one address: every way of sending
    there sends nothing and says so (``send_each`` gives its position), a line keeps its socket (its next
    send goes: a full queue is no peer gone), and the sends to another address go."""
    me, here = {1: this_process()}, parent_box.path
    other = Mailbox(NS + "-other", this_process())  # (a second mailbox of this process: another address)
    try:
        there = other.path
        assert parent_box.send_to(here, 5, 1, 0, [b"x"]) and parent_box.send_to(there, 5, 1, 0, [b"x"])
        line = parent_box.line(1, 1, this_process(), 0, 1)  # (to this process's mailbox: ``here``)
        tried: list[tuple[str, str]] = []

        def full(point: str, what: str) -> None:
            tried.append((point, what))
            if point == "send" and what == here:
                raise BlockingIOError(errno.EAGAIN, "the queue is full (injected)")

        before = inject(full)
        try:
            assert parent_box.send_to(here, 6, 1, 0, [b"a"], 0.5) is False
            assert parent_box.send_now(here, 6, 1, 0, [b"b"]) is False
            assert line.send(6, [b"c"], 1) is False
            assert parent_box.send_each([there, here, there], 6, 1, 0, [b"d"]) == [1]
        finally:
            inject(before)
        assert ("send", there) in tried and ("send", here) in tried
        assert line.send(7, [b"e"], 1) is True
        assert _queued(parent_box, 5, me) == [(1, 0, b"x")] and _queued(parent_box, 6, me) == []
        assert _queued(parent_box, 7, me) == [(1, 0, b"e")]
        assert _queued(other, 5, me) == [(1, 0, b"x")]
        assert _queued(other, 6, me) == [(1, 0, b"d"), (1, 0, b"d")]
    finally:
        other.close()


def test_a_line_whose_peer_closed_sends_nothing_and_lets_its_mailbox_connect_anew(
    parent_box: Mailbox,
) -> None:
    """A line to a peer that exited: ``send`` says False and forgets the kept socket, as ``send_now`` does, so
    that ``send_to`` then finds nobody listening (False) instead of failing on a socket the kernel
    disconnected."""
    read, write = os.pipe()

    def listen_until_told(fd: int) -> None:
        os.close(write)
        box = Mailbox(NS, this_process())
        _announce(fd)
        os.read(read, 1)  # (until the parent closes its end; then it exits, its socket with it)
        assert box.path

    pid, child = _in_child(listen_until_told)
    os.close(read)
    there = address(child, NS)
    assert parent_box.send_to(there, 5, 1, 0, [b"hello"])  # (connects, and keeps the socket)
    line = parent_box.line(1, 2, child, 0, 1)
    os.close(write)
    assert _reap(pid) == 0
    assert line.send(6, [b"claim"], 5) is False
    assert parent_box.send_to(there, 6, 1, 0, [b"claim"]) is False


def test_a_line_takes_up_the_socket_its_mailbox_connects_anew(parent_box: Mailbox) -> None:
    """A line's kept socket, once its mailbox has closed it (the peer closed its socket and bound a new one at
    the same path, and a send of the mailbox connected anew): the line's next send says False, nothing sent,
    and the one after goes through the mailbox's new socket, to the peer."""
    go_read, go_write = os.pipe()
    said_read, said_write = os.pipe()

    def listen_twice(fd: int) -> None:
        os.close(go_write)
        os.close(said_read)
        parent = pickle.loads(bytes.fromhex(os.environ["PARENT_INFO"]))
        first = Mailbox(NS, this_process())
        _announce(fd)
        os.read(go_read, 1)
        first.close()
        again = Mailbox(NS, this_process())  # (the same path)
        os.write(said_write, b"bound")
        got = _receive_all(again, 9, {1: parent}, 1)
        os.write(said_write, repr([(rank, kind, bytes(data)) for rank, kind, data in got]).encode())

    pid, child = _in_child(listen_twice)
    os.close(go_read)
    os.close(said_write)
    try:
        there = address(child, NS)
        assert parent_box.send_to(there, 5, 1, 0, [b"hello"])  # (connects, and keeps the socket)
        line = parent_box.line(1, 2, child, 0, 1)
        assert line.send(6, [b"one"], 3) is True
        os.write(go_write, b"x")
        assert os.read(said_read, 5) == b"bound"
        assert parent_box.send_to(
            there, 7, 1, 0, [b"two"]
        )  # (refused on the old socket: forgotten, connected anew)
        assert line.send(8, [b"three"], 5) is False  # (its socket was closed when forgotten)
        assert line.send(9, [b"four"], 4) is True
        assert os.read(said_read, 100) == repr([(1, 0, b"four")]).encode()
    finally:
        os.close(go_write)
        os.close(said_read)
        assert _reap(pid) == 0


def _intruder(fd: int) -> None:
    """As another user: try to list the private directory, take this group's address of a process
    that has not bound it yet, and send into the parent's socket; report what the kernel said."""
    os.setgid(65534)
    os.setuid(65534)
    parent = pickle.loads(bytes.fromhex(os.environ["PARENT_INFO"]))
    later = ProcessInfo(**{**parent.__dict__, "start_time": parent.start_time + 1})
    said = {}
    for what, act in {
        "list": lambda s: os.listdir(os.path.dirname(address(parent, NS))),
        "bind": lambda s: s.bind(address(later, NS)),
        "send": lambda s: s.sendto(b"\0" * 16 + b"from nobody", address(parent, NS)),
    }.items():
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                act(sock)
                said[what] = "done"
            except OSError as exc:
                said[what] = type(exc).__name__
    os.write(fd, pickle.dumps(said).hex().encode() + b"\n")


@pytest.mark.root
def test_another_user_can_neither_take_an_address_nor_send_nor_look(parent_box: Mailbox) -> None:
    """The sockets live in this user's private directory (mode 0700): another local user cannot bind
    an address a rank will use (and so receive its peers' claims), send into a rank's socket, or see
    which sockets there are (abstract addresses allowed all three)."""
    if os.geteuid() != 0:
        pytest.fail("this test needs root (to act as another user); run the root tests as root")
    assert stat.S_IMODE(os.stat(os.path.dirname(parent_box.path)).st_mode) == 0o700
    pid, said = _in_child(_intruder)
    assert _reap(pid) == 0
    assert said == {"list": "PermissionError", "bind": "PermissionError", "send": "PermissionError"}
    assert _queued(parent_box, 0, {1: this_process()}) == []


def test_sending_to_a_process_that_does_not_listen_says_so(parent_box: Mailbox) -> None:
    me = this_process()
    nobody = ProcessInfo(**{**me.__dict__, "start_time": me.start_time + 1})
    assert parent_box.send(nobody, 1, 0, 0, [b"x"]) is False
    with pytest.raises(MailboxError, match="larger than"):
        parent_box.send(me, 1, 0, 0, [bytes(MAX_MESSAGE_BYTES)])
    with pytest.raises(MailboxError, match="cannot listen"):
        Mailbox(NS, me)  # the same process and group: the address is taken


def test_a_closed_mailbox_says_so(parent_box: Mailbox) -> None:
    """After its group's incarnation ended (``GroupSync.close``), a mailbox neither sends nor receives."""
    parent_box.close()
    for use in (
        lambda: parent_box.send(this_process(), 1, 0, 0, [b"x"]),
        lambda: parent_box.receive(1, {}, 0.0),
    ):
        with pytest.raises(MailboxError, match="this mailbox is closed"):
            use()


def test_a_busy_process_answers_inquiries_from_its_thread(parent_box: Mailbox) -> None:
    """The child's main thread sleeps (busy elsewhere); its answering thread says what it remembers."""

    def body(fd: int) -> None:
        answer_inquiries(
            this_process(), lambda ns, call, asker, asking: (3, ["send", call]) if ns == NS else None
        )
        _announce(fd)
        time.sleep(3)

    pid, child = _in_child(body)
    try:
        assert parent_box.inquire(child, 42, 0)
        found = _receive_all(parent_box, 42, {3: child}, 1)
        assert [(rank, kind) for rank, kind, _ in found] == [(3, ANSWER)]
        assert msgpack.unpackb(found[0][2]) == [["send", 42]]
    finally:
        os.kill(pid, 9)
        _reap(pid)


def test_a_forked_child_cannot_read_its_parents_mailbox(parent_box: Mailbox) -> None:
    def body(fd: int) -> None:
        try:
            parent_box.receive(1, {}, 0.0)
        except MailboxError:
            _announce(fd)
            return
        raise AssertionError("the child read its parent's mailbox")

    pid, _ = _in_child(body)
    assert _reap(pid) == 0


def _voluntary_switches() -> int:
    """How often this thread has slept (given up its core to wait), as the kernel counts."""
    with open("/proc/thread-self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches:"))


@pytest.mark.parametrize("poll", [True, False])
def test_a_wait_polls_before_it_sleeps_only_when_told_to(
    parent_box: Mailbox, monkeypatch: pytest.MonkeyPatch, poll: bool
) -> None:
    """A child waits for the parent's message, which comes 0.3 s into its wait: told to poll (for longer
    than that) it reads it without ever sleeping; else it sleeps until it comes."""
    from distribute_utils import mailbox

    monkeypatch.setattr(mailbox, "POLL_S", 30.0)
    parent = pickle.loads(bytes.fromhex(os.environ["PARENT_INFO"]))
    results_r, results_w = os.pipe()

    def receiver(fd: int) -> None:
        box = Mailbox(NS, this_process())
        box.poll(poll)
        _announce(fd)
        before = _voluntary_switches()
        os.write(results_w, b"w")  # waiting from now on
        got = box.receive(9, {1: parent}, 10.0)
        slept = _voluntary_switches() - before
        os.write(results_w, msgpack.packb([slept, [[rank, kind, bytes(data)] for rank, kind, data in got]]))

    pid, child = _in_child(receiver)
    try:
        assert os.read(results_r, 1) == b"w"
        time.sleep(0.3)  # the child is in its wait by now
        assert parent_box.send(child, 9, 1, 0, [b"hello"], timeout=5)
        slept, got = msgpack.unpackb(os.read(results_r, 4096))
    finally:
        assert _reap(pid) == 0
        os.close(results_r)
        os.close(results_w)
    assert got == [[1, 0, b"hello"]]
    if poll:
        assert slept == 0, "it slept although told to poll"
    else:
        assert slept >= 1, "it never slept: it cannot have waited for the message"


def _listen_then_wait(fd: int) -> None:
    Mailbox(NS, this_process())
    _announce(fd)
    time.sleep(60)  # until killed


def test_the_socket_of_a_killed_process_is_found_and_cleaned_a_live_one_kept(parent_box: Mailbox) -> None:
    """A process killed outright leaves its socket's file; doctor lists it, clean removes it (never the
    socket of a live process), and a process that closes its mailbox leaves nothing."""
    pid, child = _in_child(_listen_then_wait)
    os.kill(pid, signal.SIGKILL)
    assert _reap(pid) == -signal.SIGKILL
    dead = address(child, NS)
    assert os.path.exists(dead) and dead in host_dir.dead_sockets()
    assert parent_box.path not in host_dir.dead_sockets()
    report = io.StringIO()
    hygiene.doctor(None, report)
    assert f"{dead}  nothing listens" in report.getvalue(), report.getvalue()
    out = io.StringIO()
    assert hygiene.clean(None, False, out) == 0
    assert f"removed socket {dead}" in out.getvalue() and not os.path.exists(dead), out.getvalue()
    assert os.path.exists(parent_box.path), "the live socket was kept"
    parent_box.close()
    assert not os.path.exists(parent_box.path), "a closed mailbox leaves no file"


def test_kept_connections_reach_a_peer_bound_again_say_when_none_listens_and_stay_bounded(
    tmp_path: Path,
) -> None:
    """The sockets a process keeps connected to its peers (``host_dir.Connections``, what mailboxes and
    the pool's notices send through): a peer that closed and bound its path again gets the next message;
    a path where nobody listens is a False, not an error; past ``kept`` the oldest is closed."""
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)

    def listen(name: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(directory / name))
        sock.settimeout(10)
        return sock

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    first, second = listen("a.sock"), listen("b.sock")
    kept = host_dir.Connections(kept=1)
    assert kept.send(str(directory / "a.sock"), [b"one"]) and first.recv(16) == b"one"
    first.close()
    os.unlink(directory / "a.sock")
    again = listen("a.sock")  # (the same path, a new socket: the kept one's peer is gone)
    assert kept.send(str(directory / "a.sock"), [b"two"]) and again.recv(16) == b"two"
    again.close()
    os.unlink(directory / "a.sock")
    assert kept.send(str(directory / "a.sock"), [b"three"]) is False
    gone = listen("d.sock")  # (a peer that closes and binds nothing again: refused, then disconnected)
    assert kept.send(str(directory / "d.sock"), [b"kept"]) and gone.recv(16) == b"kept"
    gone.close()
    assert kept.send_now(str(directory / "d.sock"), [b"now"]) is False
    assert kept.send(str(directory / "d.sock"), [b"again"]) is False  # (no OSError from a dead socket)
    third = listen("c.sock")
    before = open_fds()
    for _ in range(3):  # two live peers, one kept: each new one's socket replaces the other's
        assert kept.send(str(directory / "b.sock"), [b"four"]) and second.recv(16) == b"four"
        assert kept.send(str(directory / "c.sock"), [b"five"]) and third.recv(16) == b"five"
    assert open_fds() <= before + 1
    kept.close()
    assert open_fds() <= before
    second.close()
    third.close()
