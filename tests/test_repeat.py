"""Gathers repeated call after call (the same list and options), as ModelOpt's export makes them, on 4 real
ranks: exact whatever changes between calls (sizes across the attached bound, a late rank, an error, a
disagreeing rank, a rank gone), and a repeated call running fewer Python calls than the general path.

A call like the last one of its list and options that went well runs through that call's repeat
(docs/performance.md, "The repeat"); anything unlike it goes the general way. Each case below repeats a
gather enough times for the repeat to be kept, then changes one thing.
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import errno
import os
import select
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distribute_utils import (
    GatherError,
    PeerLostError,
    get_configs_parallel,
    get_tensors_parallel,
    mailbox,
    sync,
    wire,
)
from distribute_utils.transports import carriers

from harness import Died, RankPool

RANKS = [0, 1, 2, 3]
WARM = 5  # calls that make a call's repeat (one that went well is enough; a few for good measure)
# Tensor bytes that travel inside the claim message (under the 288 KiB bound) and past it, in turn.
SIZES = (4 * 2**10, 200 * 2**10, 400 * 2**10, 16, 2**20, 280 * 2**10, 300 * 2**10, 4 * 2**10)
LATE_S = 0.5  # far past the 0.05 s a repeat waits for the first message: the other ranks take the call over


def _value(rank: int, i: int, nbytes: int = 4 * 2**10) -> torch.Tensor:
    """Rank ``rank``'s tensor of call ``i``: ``nbytes`` of float32, each element telling both."""
    return torch.arange(max(nbytes // 4, 1), dtype=torch.float32) + 1000.0 * rank + 10.0 * i


def _gather(i: int, nbytes: int = 4 * 2**10, ranks: list[int] | None = None, **options: Any) -> list[str]:
    """One gather of call ``i``'s tensors to rank 0; the problems the first rank finds in what it got."""
    rank = dist.get_rank()
    ranks = RANKS if ranks is None else ranks
    with get_tensors_parallel(_value(rank, i, nbytes), ranks, timeout=30, **options) as got:
        if rank != ranks[0]:
            return []
        return [f"call {i}: rank {r}" for r, t in zip(ranks, got) if not torch.equal(t, _value(r, i, nbytes))]


def _warm(start: int = 0) -> list[str]:
    return [p for i in range(start, start + WARM) for p in _gather(i)]


def _sizes_across_the_attached_bound(**options: Any) -> list[str]:
    problems = [p for i in range(WARM) for p in _gather(i, **options)]
    for round_ in range(3):  # each size repeated, then the next: in and out of the repeat
        for j, nbytes in enumerate(SIZES):
            problems += _gather(100 * round_ + j, nbytes, **options)
            problems += _gather(100 * round_ + j + 50, nbytes, **options)
    return problems


@pytest.mark.parametrize("workspace", [False, True], ids=["no workspace", "a workspace"])
def test_sizes_across_the_attached_bound_stay_exact(
    ranks4: RankPool, no_shm_leak: None, tmp_path: Any, workspace: bool
) -> None:
    """With a workspace, payloads past the attached sizes go the general way on the first rank (the
    workspace's carrier is each call's own)."""
    options = {"workspace_path": str(tmp_path)} if workspace else {}
    assert ranks4.run(_sizes_across_the_attached_bound, **options) == [[], [], [], []]


@contextlib.contextmanager
def _sends_counted() -> Iterator[list[int]]:
    """Counts (in the list it gives, one item) this process's tries to send a message to a mailbox
    meanwhile: the mailbox fault point ``"send"``, counting (a send that cannot go at once and is tried
    again counts twice; after repeats, the sockets to the peers are kept, and each send goes at once)."""
    sends = [0]

    def counted(point: str, what: str) -> None:
        if point == "send":
            sends[0] += 1

    before = mailbox.inject(counted)
    try:
        yield sends
    finally:
        mailbox.inject(before)


def _late(who: int) -> tuple[list[str], int]:
    """After repeats, rank ``who`` comes late to a call; the problems of that call and the next, and the
    messages this rank sent to a mailbox in that call."""
    problems = _warm()
    if dist.get_rank() == who:
        threading.Event().wait(LATE_S)  # (only steers the path: any outcome but the exact one fails)
    with _sends_counted() as sends:
        problems += _gather(WARM)
    return problems + _warm(WARM + 1), sends[0]  # and the calls after it go well


def _claim_refused_after_repeats(refused: int) -> tuple[list[str], int, float]:
    """After repeats, rank 1's next ``refused`` sends are refused as a full queue refuses them (the mailbox
    fault point ``"send"``): its claim through its line, then as the call's channel posts it at once, then
    within the grace. The first rank's problems, the sends refused, and the seconds the call took."""
    rank = dist.get_rank()
    problems = _warm()
    count = [0]

    def full(point: str, what: str) -> None:
        if point == "send" and count[0] < refused:
            count[0] += 1
            raise BlockingIOError(errno.EAGAIN, "the first rank's queue is full (injected)")

    dist.barrier()
    started = time.monotonic()
    before = mailbox.inject(full) if rank == 1 else None
    try:
        problems += _gather(WARM)
    finally:
        if rank == 1:
            mailbox.inject(before)
    return problems, count[0], time.monotonic() - started


@pytest.mark.parametrize(
    "refused", [1, 2, 3], ids=["its line", "its line and the post at once", "every try within the grace"]
)
def test_a_claim_that_cannot_go_is_posted_again_until_it_does(ranks4: RankPool, refused: int) -> None:
    """A repeated sender whose claim cannot go (the first rank's queue full) posts it as the general path
    does; one that could not go within the grace is handed to the general sender as not delivered, which
    sends it again until it goes: the call ends exactly and at once, not at the 30 s timeout (a hand-over
    that took the claim for delivered would wait for a verdict to a claim the first rank never got)."""
    for rank, (problems, count, took) in enumerate(ranks4.run(_claim_refused_after_repeats, refused)):
        assert problems == [], (rank, problems)
        assert count == (refused if rank == 1 else 0), (rank, count)
        assert took < 10, (rank, took)  # (generous: a loaded machine; broken, they wait the 30 s)


@pytest.mark.parametrize("who", [0, 3], ids=["first rank late", "sender late"])
def test_a_late_rank_is_taken_over_exactly(ranks4: RankPool, who: int) -> None:
    """The ranks on time hear nothing within the grace and hand the call to the general roles, which end it
    exactly; a claim that went is not sent again (a hand-over that took it for undelivered would), and the
    first rank sends each sender its verdict."""
    assert ranks4.run(_late, who) == [([], 3), ([], 1), ([], 1), ([], 1)]


def _error_after_repeats(case: str) -> list[str]:
    """After repeats, one call fails in ``case``'s way on one rank; every rank's error, then the next
    calls' problems."""
    rank = dist.get_rank()
    problems = _warm()
    config: Any = {"i": WARM}
    ranks, options = RANKS, {}
    if case == "unencodable value" and rank == 2:
        config = {"i": WARM, "act": lambda x: x}
    elif case == "unplaceable value" and rank == 0:  # (the first rank's value is placed, not encoded)
        config = {"i": WARM, "act": collections.Counter(a=1)}
    elif case == "another transport" and rank == 1:
        options = {"transport": "shm"}
    elif case == "another order" and rank == 1:
        ranks = [0, 2, 1, 3]
    for _ in range(WARM):  # the config gather's own repeat
        with get_configs_parallel({"i": 0}, RANKS, timeout=30):
            pass
    try:
        with get_configs_parallel(config, ranks, timeout=30, **options):
            pass
    except (GatherError, TypeError, ValueError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "no error"
    with get_configs_parallel({"i": rank}, RANKS, timeout=30) as got:  # the next call goes well
        if rank == 0 and got != [{"i": r} for r in RANKS]:
            problems.append(f"after the error: {got}")
    return [outcome, *problems, *_warm(WARM + 1)]


@pytest.mark.parametrize(
    ("case", "culprit", "says"),
    [
        ("unencodable value", 2, "['act']"),
        ("unplaceable value", 0, "['act']"),
        ("another transport", 1, "transport"),
        ("another order", 1, "ranks disagree on a gather"),
    ],
)
def test_an_error_after_repeats_reaches_every_rank(
    ranks4: RankPool, case: str, culprit: int, says: str
) -> None:
    results = ranks4.run(_error_after_repeats, case)
    for rank, (outcome, *problems) in enumerate(results):
        assert outcome != "no error" and says in outcome, (rank, outcome)
        if rank != culprit:
            assert f"rank {culprit}" in outcome or f"({culprit})" in outcome, (rank, outcome)
        assert problems == [], (rank, problems)


def _a_tensor_that_does_not_encode() -> tuple[str, list[str]]:
    """After tensor repeats, rank 2 passes a tensor that does not encode (a nested one: its ``shape``
    raises); every rank's outcome, then the next calls' problems."""
    rank = dist.get_rank()
    problems = _warm()
    value = _value(rank, WARM)
    if rank == 2:
        with warnings.catch_warnings():  # (torch's note that nested tensors are a prototype)
            warnings.simplefilter("ignore")
            value = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    try:
        with get_tensors_parallel(value, RANKS, timeout=30):
            pass
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "no error"
    return outcome, problems + _warm(WARM + 1)


def test_a_tensor_that_does_not_encode_after_repeats_fails_every_rank_at_once(ranks4: RankPool) -> None:
    """The kept head's checks raise on it (wire.LoneHead): the call goes the general way, which posts the
    error, as it does for any value that does not encode; nobody waits for rank 2 until the timeout."""
    for rank, (outcome, problems) in enumerate(ranks4.run(_a_tensor_that_does_not_encode)):
        assert outcome != "no error", rank
        if rank != 2:
            assert outcome.startswith("GatherError") and "rank 2" in outcome, (rank, outcome)
        assert problems == [], (rank, problems)


def _interrupt_at(code: types.CodeType, landed: list[bool]) -> None:
    """Raise KeyboardInterrupt as this thread next enters the function of ``code``: a Ctrl-C there. Appends
    to ``landed`` whether a sender's repeat (``SenderRepeat.send`` in roles/repeat.py) is on the stack."""

    def trace(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            sys.settrace(None)
            caller: types.FrameType | None = frame
            while caller is not None and not (
                caller.f_code.co_name == "send" and caller.f_code.co_filename.endswith("roles/repeat.py")
            ):
                caller = caller.f_back
            landed.append(caller is not None)
            raise KeyboardInterrupt

    sys.settrace(trace)


_INTERRUPTED_AT = {
    "LoneHead.bytes_of": wire.LoneHead.bytes_of.__code__,
    "LoneHead.payload": wire.LoneHead.payload.__code__,  # (a lone tensor's payload past the attached sizes)
    "wire.encode": wire.encode.__code__,  # (a tensor of a new shape: the repeat encodes it)
    "carriers.publish": carriers.publish.__code__,
    "Call.record": sync.Call.record.__code__,  # (a sender's repeat records its call as its claim goes)
}


def _interrupted_after_repeats(
    nbytes: int, where: str
) -> tuple[str, list[str], list[str], list[bool], float]:
    """After repeats (past the attached sizes in named segments, which could be left), rank 2's call is
    interrupted in ``where``; every rank's outcome, the next calls' problems, its segments left, whether
    the interrupt landed in a sender's repeat (rank 2), and the seconds the call took. (A rank past a
    repeat's grace, on a loaded machine, drops its repeat, and its next call goes the general way: where
    the interrupt did not land in rank 2's repeat, the repeats are made again and it is tried again, a
    few times at most.)"""
    from distribute_utils.transports import shm

    shm.SharedMemoryTransport.pooling = False  # (documented seam: every segment a named one)
    tracer = sys.gettrace()  # (a coverage tool's, put back)
    try:
        rank = dist.get_rank()
        problems: list[str] = []
        for attempt in range(3):
            base = 10 * WARM * attempt
            problems = [p for i in range(base, base + WARM) for p in _gather(i, nbytes)]
            landed: list[bool] = []
            started = time.monotonic()
            try:
                if rank == 2:
                    _interrupt_at(_INTERRUPTED_AT[where], landed)
                try:
                    value = _value(rank, base + WARM, nbytes)
                    if where == "wire.encode":
                        value = value.reshape(2, -1)  # (no head kept for this shape: encoded)
                    with get_tensors_parallel(value, RANKS, timeout=30):  # (the repeat's key)
                        pass
                finally:
                    sys.settrace(tracer)
            except (KeyboardInterrupt, GatherError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            else:
                outcome = "no error"
            took = time.monotonic() - started
            in_repeat = torch.tensor([int(landed == [True])])
            dist.all_reduce(in_repeat)  # (whether rank 2's interrupt landed in its repeat: all stop trying)
            if in_repeat.item():
                break
        left = sorted(
            n for n in os.listdir("/dev/shm") if n.startswith("du_") and n.endswith(f"_{os.getpid()}")
        )
        later = [p for i in range(base + WARM + 1, base + 2 * WARM) for p in _gather(i, nbytes)]
        return outcome, problems + later, left, landed, took
    finally:
        shm.SharedMemoryTransport.pooling = True


@pytest.mark.parametrize(
    ("nbytes", "where"),
    [
        (4 * 2**10, "LoneHead.bytes_of"),
        (2**20, "LoneHead.payload"),
        (2**20, "wire.encode"),
        (2**20, "carriers.publish"),
        (2**20, "Call.record"),
    ],
    ids=[
        "in the claim",
        "in a segment, making its payload",
        "in a segment, encoding a new shape",
        "in a segment, publishing",
        "in a segment, claiming",
    ],
)
def test_an_interrupt_inside_a_repeat_reaches_every_rank(ranks4: RankPool, nbytes: int, where: str) -> None:
    """The interrupted rank raises it, inside its repeat, and its partners hear that it failed with it well
    within the call's 30 s timeout (not, a timeout later, that it did not arrive); what it published is
    removed. (An interrupt once its claim has gone is heard as the general path hears it: the first rank
    says what it made of the claim.)"""
    for rank, (outcome, problems, left, landed, took) in enumerate(
        ranks4.run(_interrupted_after_repeats, nbytes, where)
    ):
        if rank == 2:
            assert outcome.startswith("KeyboardInterrupt") and landed == [True], (outcome, landed)
        else:
            assert "rank 2" in outcome and "KeyboardInterrupt" in outcome, (rank, outcome)
            assert took < 15, (rank, took)  # (generous: a loaded machine; broken, they wait the 30 s)
        assert problems == [] and left == [], (rank, problems, left)


def _interrupted_after_its_claim() -> tuple[str, int, list[str]]:
    """After repeats, rank 2's call is interrupted as it waits for its verdict, its claim gone through its
    line; every rank's outcome of that call, this rank's tries to send in it, and the problems of the calls
    around it. (A rank past a repeat's grace, on a loaded machine, drops its repeat: its next call goes the
    general way, which reads its verdict otherwise; the next one is tried then, a few at most.)"""
    rank = dist.get_rank()
    problems = _warm()
    tracer = sys.gettrace()  # (a coverage tool's, put back)
    for i in range(WARM, WARM + 5):
        landed: list[bool] = []
        with _sends_counted() as sends:
            if rank == 2:
                _interrupt_at(mailbox.Mailbox.take_next.__code__, landed)
            try:
                try:
                    problems += _gather(i)
                finally:
                    sys.settrace(tracer)
            except KeyboardInterrupt:
                outcome = "KeyboardInterrupt"
            else:
                outcome = "no error"
        if rank == 2 and landed not in ([], [True]):
            outcome += " outside its repeat"
        heard = torch.tensor([len(landed)])
        dist.all_reduce(heard)  # (whether rank 2 was interrupted: every rank then stops trying)
        if heard.item():
            break
    return outcome, sends[0], problems + _warm(i + 1)


def test_a_sender_interrupted_after_its_claim_went_sends_nothing_more(ranks4: RankPool) -> None:
    """An interrupt once a repeated sender's claim has gone through its line is raised there, and the call
    goes well for its partners (the first rank took the claim); the give-up sends no second claim to the
    first rank, which has its claim already (one that took it for undelivered would), and the next calls
    go well."""
    assert ranks4.run(_interrupted_after_its_claim) == [
        ("no error", 3, []),
        ("no error", 1, []),
        ("KeyboardInterrupt", 1, []),
        ("no error", 1, []),
    ]


def _rank_gone(
    victim: int, after_its_exit: bool = False, nbytes: int = 4 * 2**10, named: bool = False
) -> str:
    """After repeats, ``victim`` exits; what each other rank's next call raised, its problems, and the
    segments of its own left in /dev/shm (``named``: every segment a named one, which could be left)."""
    from distribute_utils.transports import shm

    shm.SharedMemoryTransport.pooling = not named  # (documented seam: every segment a named one)
    problems = [p for i in range(WARM) for p in _gather(i, nbytes)]
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == victim:
        os._exit(0)  # a rank whose script ended early: it never makes the next call
    if after_its_exit:  # the next call starts once its process (and its sockets) are gone
        gone = os.pidfd_open(pids[victim])
        try:
            assert select.select([gone], [], [], 60)[0], f"rank {victim} did not exit"
        finally:
            os.close(gone)
    try:
        _gather(WARM, nbytes)
    except PeerLostError as exc:
        left = sorted(
            n for n in os.listdir("/dev/shm") if n.startswith("du_") and n.endswith(f"_{os.getpid()}")
        )
        return f"{exc.missing}|{exc}|{problems}|{left}"
    return "no error"


@pytest.mark.parametrize(
    ("victim", "after_its_exit", "nbytes", "named"),
    [
        (2, False, 4 * 2**10, False),
        (0, False, 4 * 2**10, False),
        (0, True, 4 * 2**10, False),
        (0, True, 2**20, True),
        (2, False, 2**20, False),
    ],
    ids=[
        "a sender",
        "the first rank",
        "the first rank, gone before the claims",
        "the first rank, gone before named segments' claims",
        "a sender of pooled segments",
    ],
)
def test_a_rank_gone_after_repeats_is_named(
    fresh_job: Callable[[int], RankPool], victim: int, after_its_exit: bool, nbytes: int, named: bool
) -> None:
    """Also where the senders' kept sockets find the first rank's closed (the kernel refuses, then
    disconnects them): a PeerLostError naming it, not an OSError; and past the attached sizes, where a
    sender's repeat has published its payload in a segment before its claim finds the first rank gone:
    the segment is removed."""
    results = fresh_job(4).run(_rank_gone, victim, after_its_exit, nbytes, named, expect_deaths=True)
    assert isinstance(results[victim], Died), results[victim]
    for rank in {0, 1, 2, 3} - {victim}:
        missing, message, problems, left = results[rank].split("|")
        assert missing == f"({victim},)" and f"rank(s) [{victim}] exited" in message, (rank, message)
        assert problems == "[]", problems
        assert left == "[]", (rank, left)


def _profiled_repeats(values: list[torch.Tensor]) -> Any:
    """cProfile's stats of repeated gathers of ``values`` (after 50 of their size that make the repeat), on
    ranks 0 and 1 (None on the others)."""
    for i in range(50):
        _gather(i, values[0].nbytes)
    dist.barrier()
    profile = cProfile.Profile()
    profile.enable()
    for value in values:
        with get_tensors_parallel(value, RANKS):
            pass
    profile.disable()
    dist.barrier()
    if dist.get_rank() > 1:
        return None
    profile.create_stats()
    return profile.stats  # type: ignore[attr-defined]


def _general_calls_past_the_attached_sizes(rounds: int, **options: Any) -> dict[str, float] | None:
    """Per repeated 1 MiB gather (after 4 KiB ones made the call's repeat): on rank 1, the calls of the general
    sender's ``send``; on rank 0, of the general first rank's ``receive`` and of ``wire.decode`` (None
    elsewhere)."""
    for i in range(WARM):
        _gather(i, **options)
    for i in range(WARM):
        _gather(i, 2**20, **options)
    dist.barrier()
    profile = cProfile.Profile()
    profile.enable()
    problems = [p for i in range(rounds) for p in _gather(i, 2**20, **options)]
    profile.disable()
    assert problems == [], problems
    if dist.get_rank() > 1:
        return None
    profile.create_stats()
    stats = profile.stats  # type: ignore[attr-defined]
    calls = collections.Counter({(f.rsplit("/", 1)[-1], name): s[1] for (f, _, name), s in stats.items()})
    wanted = (
        [("sender.py", "send")]
        if dist.get_rank()
        else [("first_rank.py", "receive"), ("decoding.py", "decode")]
    )
    return {f"{file}:{name}": calls[(file, name)] / rounds for file, name in wanted}


def test_a_repeat_past_the_attached_sizes_goes_through_the_carriers_of_its_host(ranks4: RankPool) -> None:
    """A sender's repeat made of small calls learns the host route of the first call past the attached
    sizes (a segment), and publishes the next such payloads through it: the general sender runs no more.
    The first rank's repeat fetches them through the carriers their receipts name, and views each payload
    whose head is its sender's last one: no general first rank, no decoding."""
    first, sender, *_ = ranks4.run(_general_calls_past_the_attached_sizes, 40)
    # (a round past the repeat's grace on a loaded machine goes the general way: a few in 40)
    assert sender is not None and sender["sender.py:send"] < 0.25, sender
    assert first is not None and first["first_rank.py:receive"] < 0.25, first
    assert first["decoding.py:decode"] < 0.5, first


def test_with_a_workspace_payloads_past_the_attached_sizes_go_the_general_way(
    ranks4: RankPool, tmp_path: Any
) -> None:
    """A workspace's carrier is each call's own: neither role's repeat keeps a route or context for it."""
    first, sender, *_ = ranks4.run(_general_calls_past_the_attached_sizes, 10, workspace_path=str(tmp_path))
    assert sender is not None and sender["sender.py:send"] == 1, sender
    assert first is not None and first["first_rank.py:receive"] == 1, first


def _first_rank_fails_past_the_attached_sizes() -> list[str]:
    """Repeats of 1 MiB gathers in named segments (no pool), then a call whose first rank passes no tensor;
    every rank's error, then the next calls' problems."""
    from distribute_utils.transports import shm

    shm.SharedMemoryTransport.pooling = False  # (documented seam: every segment a named one)
    try:
        rank = dist.get_rank()
        problems = [p for i in range(WARM) for p in _gather(i, 2**20)]
        value: Any = {"not": "a tensor"} if rank == 0 else _value(rank, WARM, 2**20)
        try:
            with get_tensors_parallel(value, RANKS, timeout=30):
                pass
        except (GatherError, TypeError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        else:
            outcome = "no error"
        return [outcome, *problems, *(p for i in range(WARM + 1, 2 * WARM) for p in _gather(i, 2**20))]
    finally:
        shm.SharedMemoryTransport.pooling = True


def test_a_failed_call_after_repeats_past_the_attached_sizes_removes_their_segments(
    ranks4: RankPool, no_shm_leak: None
) -> None:
    """The senders' repeats have published named segments when the first rank's error comes: each sender
    raises it, and removes its segment (the fixture: nothing left in /dev/shm)."""
    for rank, (outcome, *problems) in enumerate(ranks4.run(_first_rank_fails_past_the_attached_sizes)):
        assert "get_tensors_parallel gathers a torch.Tensor" in outcome, (rank, outcome)
        assert problems == [], (rank, problems)


def _calls_per_repeat(rounds: int) -> float | None:
    """Python calls (every call cProfile counts) per repeated 4 KiB gather on ranks 0 and 1."""
    stats = _profiled_repeats([_value(dist.get_rank(), 0)] * rounds)
    return None if stats is None else sum(entry[1] for entry in stats.values()) / rounds


def _kinds(rank: int, i: int, side: int) -> torch.Tensor:
    """Call ``i``'s tensor of ``rank``: ``side`` squared elements of 4 bytes each time, of a dtype and shape
    that change every few calls."""
    n = side * side
    dtype, shape = [(torch.float32, (n,)), (torch.int32, (n,)), (torch.float32, (side, side))][i // 3 % 3]
    return (torch.arange(n) + 1000 * rank + 10 * i).to(dtype).reshape(shape)


def _same_size_other_kinds(side: int) -> list[str]:
    rank, problems = dist.get_rank(), []
    for i in range(18):
        with get_tensors_parallel(_kinds(rank, i, side), RANKS, timeout=30) as got:
            for r, t in zip(RANKS, got):
                want = _kinds(r, i, side)
                if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t, want):
                    problems.append(f"call {i}: rank {r}")
    return problems


def _tokens_past_the_attached_sizes() -> tuple[list[tuple[str, bool]], list[str]]:
    """Gathers of 1 MiB: in pooled segments, then in named ones (the seam ``pooling``), then pooled again;
    each payload's token through the shared-memory carrier on this rank, whether a name was made of it
    (a segment named after it in /dev/shm), and the first rank's problems."""
    from distribute_utils.transports import shm

    published: list[tuple[str, bool]] = []
    publish = shm.SharedMemoryTransport.publish

    def spy(self: shm.SharedMemoryTransport, token: str, r: int, payload: Any) -> str:
        receipt = publish(self, token, r, payload)
        published.append((token, os.path.exists(shm.segment_path(token, r, os.getpid()))))
        return receipt

    shm.SharedMemoryTransport.publish = spy  # type: ignore[method-assign]
    problems: list[str] = []
    try:
        for i in range(18):
            shm.SharedMemoryTransport.pooling = not 6 <= i < 12  # (documented seam: named segments only)
            problems += _gather(i, 2**20)
    finally:
        shm.SharedMemoryTransport.publish = publish  # type: ignore[method-assign]
        shm.SharedMemoryTransport.pooling = True
    return published, problems


def test_a_repeat_keeps_its_token_only_while_no_name_was_made_of_it(ranks4: RankPool) -> None:
    """A sender's repeat publishes a payload past the attached sizes under its last payload's token while
    that named nothing (a pooled segment: the same claim bytes, checked once), and a token of which a name
    was made (a named segment, which other users can see) is never used again: no name can be predicted
    from an earlier one."""
    first, *senders = ranks4.run(_tokens_past_the_attached_sizes)
    assert first == ([], []), first
    for rank, (published, problems) in enumerate(senders, 1):
        assert problems == [] and len(published) == 18, (rank, published)
        assert [named for _, named in published] == [i in range(6, 12) for i in range(18)], (rank, published)
        for i, (token, named) in enumerate(published):
            if named:
                assert token not in [t for t, _ in published[i + 1 :]], (rank, i, published)
        pooled = [t for t, named in published if not named]
        assert len(set(pooled)) < len(pooled), (rank, published)  # (kept while it named nothing)


def _tokens_around_a_failed_publish() -> tuple[list[tuple[str, str]], list[str]]:
    """Gathers of 1 MiB through shared memory only: pooled, then named (the seam ``pooling``) while another
    process of this user holds the name the kept token would give (made here, as one that guessed it
    would), then pooled again; each publication's token through the carrier on this rank and what came of
    it ("pooled", "named" or "failed"), and the first rank's problems."""
    from distribute_utils.transports import shm

    published: list[tuple[str, str]] = []
    publish = shm.SharedMemoryTransport.publish

    def spy(self: shm.SharedMemoryTransport, token: str, r: int, payload: Any) -> str:
        try:
            receipt = publish(self, token, r, payload)
        except OSError:
            published.append((token, "failed"))
            raise
        named = os.path.exists(shm.segment_path(token, r, os.getpid()))
        published.append((token, "named" if named else "pooled"))
        return receipt

    shm.SharedMemoryTransport.publish = spy  # type: ignore[method-assign]
    problems: list[str] = []
    taken: list[str] = []
    try:
        for i in range(12):
            shm.SharedMemoryTransport.pooling = not 6 <= i < 9  # (documented seam: named segments only)
            if i == 6 and dist.get_rank() != 0 and published:
                path = shm.segment_path(published[-1][0], dist.get_rank(), os.getpid())
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                taken.append(path)
            problems += _gather(i, 2**20, transport="shm")
    finally:
        shm.SharedMemoryTransport.publish = publish  # type: ignore[method-assign]
        shm.SharedMemoryTransport.pooling = True
        for path in taken:
            os.unlink(path)
    return published, problems


def test_a_token_whose_publish_failed_is_not_used_again(ranks4: RankPool) -> None:
    """A sender's repeat whose publish under its kept token fails (the name taken: a named segment is made
    O_EXCL) takes a fresh token for the next one: a name a failed publish made, or that another process
    holds, is never tried again (with the token kept, every later call would fail there and go the
    general way)."""
    first, *senders = ranks4.run(_tokens_around_a_failed_publish)
    assert first == ([], []), first
    for rank, (published, problems) in enumerate(senders, 1):
        assert problems == [], (rank, problems)
        assert sum(outcome == "failed" for _, outcome in published) == 1, (rank, published)
        for i, (token, outcome) in enumerate(published):
            if outcome != "pooled":
                assert token not in [t for t, _ in published[i + 1 :]], (rank, i, published)


@pytest.mark.parametrize("side", [32, 512], ids=["4 KiB, in the claim", "1 MiB, in a segment"])
def test_a_payload_of_the_same_size_but_another_dtype_or_shape_is_decoded_as_sent(
    ranks4: RankPool, side: int
) -> None:
    """A repeat keeps each sender's last payload head (wire.LoneHead): a payload of the same length whose
    head differs is decoded in full, never viewed with the head kept."""
    assert ranks4.run(_same_size_other_kinds, side) == [[], [], [], []]


def _codec_calls_per_repeat(rounds: int, nbytes: int) -> tuple[float, ...] | None:
    """``wire.encode``, ``wire.decode`` and claim (or verdict) unpacking calls per repeated gather of
    ``nbytes`` on ranks 0 and 1 (each call's tensors new)."""
    stats = _profiled_repeats([_value(dist.get_rank(), i, nbytes) for i in range(rounds)])
    if stats is None:
        return None
    calls = collections.Counter({(f.rsplit("/", 1)[-1], name): s[1] for (f, _, name), s in stats.items()})
    counted = [("encoding.py", "encode"), ("decoding.py", "decode"), ("part.py", "unpack")]
    return tuple(calls[key] / rounds for key in counted)


@pytest.mark.parametrize("nbytes", [4 * 2**10, 2**20], ids=["4 KiB, in the claim", "1 MiB, in a segment"])
def test_a_repeated_tensor_gather_encodes_and_decodes_no_payload_head_again(
    ranks4: RankPool, nbytes: int
) -> None:
    """A sender sends the next tensor of its last one's dtype and shape behind that payload's head, inside
    its claim message or through its host route, and the first rank views a payload whose head is its
    sender's last one (wire.LoneHead); a sender's repeat sends a pooled segment again in the same claim
    bytes (under the token it keeps while no name was made of it), which the first rank does not unpack
    and check again."""
    first, sender, *_ = ranks4.run(_codec_calls_per_repeat, 100, nbytes)
    # Without: 3 decodes per round on the first rank, 1 encode on a sender; at 1 MiB, with a fresh token
    # per call, 3 claims unpacked per round. A round that goes the general way (a rank past the repeat's
    # grace on a loaded machine) starts a new repeat, whose first payloads are decoded: a few in 100 rounds.
    assert first is not None and first[1] < 0.5 and first[2] < 0.5, first
    assert sender is not None and sender[0] < 0.5, sender


def test_a_repeated_call_runs_fewer_python_calls(ranks4: RankPool) -> None:
    """The general path runs about 270 calls per round on the first rank and 120 on a sender; a repeat
    about 130 and 80 (docs/performance.md; ``scripts/profile_round.py`` prints them by function)."""
    first, sender, *_ = ranks4.run(_calls_per_repeat, 200)
    assert first is not None and first < 210, first
    assert sender is not None and sender < 105, sender
