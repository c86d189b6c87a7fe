"""Direct messages between processes of one host (distribute_utils.mailbox), with real processes."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from distribute_utils.mailbox import ANSWER, MAX_MESSAGE_BYTES, Mailbox, MailboxError, answer_inquiries
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


@pytest.mark.root
def test_a_message_from_another_user_is_dropped(parent_box: Mailbox) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (to send as another user); run the root tests as root")
    pid, child = _in_child(_sender([(5, 0, b"from nobody")], uid=65534))
    assert _reap(pid) == 0  # it sent before it exited
    assert _queued(parent_box, 5, {1: child}) == []


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
        answer_inquiries(this_process(), lambda ns, call: (3, ["send", call]) if ns == NS else None)
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
