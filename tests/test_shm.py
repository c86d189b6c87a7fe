"""The shared-memory transport on its own: names, modes, exact sizes, the segment pool, owner checks."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest
import torch

from distribute_utils import PayloadError, PeerLostError, wire
from distribute_utils.roles import ATTACHED_MAX_BYTES
from distribute_utils.transports import shm

PID = os.getpid()
REPORTS = shm.SharedMemoryTransport.reports  # this process's freed reports, as a receiver


def _ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("du_") and n.endswith(f"_{PID}")}


def _transport() -> shm.SharedMemoryTransport:
    return shm.SharedMemoryTransport()


def test_segment_is_private_exact_and_gone_after_fetch() -> None:
    transport = _transport()
    payload = wire.encode({"w": torch.arange(1000, dtype=torch.int32)})
    receipt = transport.publish("00000000000000aa", 1, payload)
    assert receipt == f"n:{PID}:{payload.nbytes}"
    path = shm.segment_path("00000000000000aa", 1, PID)
    info = os.stat(path)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == payload.nbytes
    buf = transport.fetch("00000000000000aa", 1, receipt)
    assert not os.path.exists(path)  # unlinked at attach
    assert torch.equal(wire.decode(buf)["w"], torch.arange(1000, dtype=torch.int32))
    transport.release("00000000000000aa", 1)  # idempotent after the reader took it


def test_publishing_twice_under_one_name_is_refused() -> None:
    transport = _transport()
    payload = wire.encode(1)
    transport.publish("00000000000000ab", 1, payload)
    try:
        with pytest.raises(FileExistsError):
            transport.publish("00000000000000ab", 1, payload)
    finally:
        transport.release("00000000000000ab", 1)
    assert _ours() == set()


def test_a_segment_whose_size_disagrees_with_its_receipt_is_rejected() -> None:
    transport = _transport()
    receipt = transport.publish("00000000000000ac", 1, wire.encode(torch.zeros(100)))
    path = shm.segment_path("00000000000000ac", 1, PID)
    os.truncate(path, 64)
    with pytest.raises(PayloadError, match=r"holds 64 bytes but its receipt says"):
        transport.fetch("00000000000000ac", 1, receipt)
    assert not os.path.exists(path)
    with pytest.raises(PayloadError, match="published no usable segment"):
        transport.fetch("00000000000000ad", 1, receipt)
    with pytest.raises(PayloadError, match="malformed shared-memory receipt"):
        transport.fetch("00000000000000ad", 1, "n:../../etc:1")


def test_a_segment_whose_payload_disagrees_with_its_receipt_is_rejected() -> None:
    """A segment large enough for its receipt, holding a payload of another length (the prefix's
    stated length is compared; decode checks the rest of the prefix)."""
    transport = _transport()
    payload = wire.encode(torch.zeros(100))
    receipt = transport.publish("00000000000000ae", 1, payload)
    kind, pid, size = receipt.split(":")
    assert wire.stated_length(payload.to_bytes()) == int(size) == payload.nbytes
    path = shm.segment_path("00000000000000ae", 1, PID)
    os.truncate(path, payload.nbytes + 64)
    with pytest.raises(
        PayloadError, match=rf"holds a payload of {payload.nbytes} bytes, not {payload.nbytes + 64}"
    ):
        transport.fetch("00000000000000ae", 1, f"{kind}:{pid}:{payload.nbytes + 64}")
    assert not os.path.exists(path)
    with pytest.raises(PayloadError, match="payload prefix needs 32 bytes, got 31"):
        wire.stated_length(bytes(31))


def test_segments_not_private_to_this_user_are_refused() -> None:
    """What another local user could plant: a file of another owner, a loose mode, a symlink."""
    transport = _transport()
    token = "00000000000000ae"
    payload = wire.encode(torch.ones(10))
    receipt = transport.publish(token, 1, payload)
    path = shm.segment_path(token, 1, PID)
    os.chmod(path, 0o644)
    with pytest.raises(PayloadError, match="has mode 644, not 600"):
        transport.fetch(token, 1, receipt)
    receipt = transport.publish(token, 1, payload)
    os.chown(path, 65534, 65534)  # as root: hand it to "nobody", as if nobody had made it
    with pytest.raises(PayloadError, match="belongs to uid 65534, not to this job's user"):
        transport.fetch(token, 1, receipt)
    target = os.path.join(shm.SHM_DIR, f"du-test-target-{PID}")
    transport.publish(token, 1, payload)
    os.rename(path, target)
    os.symlink(target, path)
    try:
        with pytest.raises(PayloadError, match="published no usable segment"):
            transport.fetch(token, 1, receipt)
    finally:
        os.unlink(target)
        transport.release(token, 1)
    assert _ours() == set()


def test_pooled_segment_is_invisible_busy_until_freed_then_reused() -> None:
    transport = shm.SharedMemoryTransport(pool=True)
    big = torch.arange(2 * 2**20, dtype=torch.float32)  # 8 MiB, above the pool threshold
    receipt = transport.publish("00000000000000b0", 1, wire.encode(big))
    assert receipt.startswith("p:"), "a large payload goes through a pooled segment"
    _, _, ident, fd, inode, _, notice = receipt.split(":")
    assert stat.S_IMODE(os.fstat(int(fd)).st_mode) == 0o600
    assert _ours() == set(), "a pooled segment never has a name in /dev/shm"
    got = wire.decode(transport.fetch("00000000000000b0", 1, receipt))
    # While the receiver holds views, the segment is busy: the next round gets another one.
    second = transport.publish("00000000000000b1", 1, wire.encode(big * 2))
    assert second.startswith("p:") and second.split(":")[2] != ident and second.split(":")[4] != inode
    kept = wire.decode(transport.fetch("00000000000000b1", 1, second))
    assert torch.equal(got, big) and torch.equal(kept, big * 2)
    # Dropping the views tells the sender at once (its notice socket): the warm segment is written
    # again at the next round, with no report left for a verdict.
    del got
    assert [1, ident, PID] not in REPORTS.take({PID: 1}), "the report went one way only"
    third = transport.publish("00000000000000b2", 1, wire.encode(big * 3))
    assert third == receipt, "the freed warm segment is written again"
    assert torch.equal(wire.decode(transport.fetch("00000000000000b2", 1, third)), big * 3)
    assert torch.equal(kept, big * 2), "a busy segment's views are never overwritten"
    # A receipt whose inode does not match is refused; so is one that names no socket properly.
    with pytest.raises(PayloadError, match="not the segment it published"):
        transport.fetch("00000000000000b4", 1, f"p:{PID}:{ident}:{fd}:1:{big.nbytes}:{notice}")
    with pytest.raises(PayloadError, match="malformed shared-memory receipt"):
        transport.fetch("00000000000000b4", 1, f"p:{PID}:{ident}:{fd}:{inode}:{big.nbytes}:../x")
    small = transport.publish("00000000000000b3", 1, wire.encode(torch.zeros(10)))
    assert small.startswith("n:")
    wire.decode(transport.fetch("00000000000000b3", 1, small))
    assert _ours() == set()


def test_without_a_notice_socket_the_report_waits_for_a_verdict() -> None:
    """A receipt naming no notice socket (the sender could not listen), or one nobody listens on
    (the sender is gone): the report is kept for the next verdict, and only then frees the segment."""
    _empty_pools()
    transport = shm.SharedMemoryTransport(pool=True)
    big = torch.arange(2**18, dtype=torch.float32)
    for notice in ("", "0123456789abcdef"):
        receipt = transport.publish("00000000000000b5", 1, wire.encode(big))
        ident = receipt.split(":")[2]
        quiet = ":".join([*receipt.split(":")[:6], notice])
        got = wire.decode(transport.fetch("00000000000000b5", 1, quiet))
        assert torch.equal(got, big)
        del got
        assert [1, ident, PID] in REPORTS.take({PID: 1}), notice
        other = transport.publish("00000000000000b6", 1, wire.encode(big)).split(":")[2]
        assert other != ident, "still busy for the sender until the report reaches it"
        # As the next verdict does (the other was never fetched).
        REPORTS.heed(1, [[1, ident, PID], [1, other, PID]])
        _empty_pools()


def test_a_notice_from_another_process_than_the_receiver_is_ignored() -> None:
    from distribute_utils.processes import this_process

    pool = shm.SegmentPool()
    seg = pool.take(2**20)
    assert seg is not None
    pool.fit(seg, 2**20, 1)
    seg.receiver = this_process()
    pool.heed([(PID + 1, seg.ident)])
    assert seg.busy, "a notice from a process the segment was not lent to"
    pool.heed([(PID, seg.ident)])
    assert not seg.busy
    pool.discard(seg)


def test_a_closed_pools_segment_is_freed_by_the_notice_another_pool_reads() -> None:
    """A pool closed while its segment is lent (its group is gone) still hears the receiver's notice: the
    next group's pool, which reads this process's notices at its sends, frees its own segments first and
    hands it the rest; the closed pool's segment is then given back."""
    _empty_pools()
    old_pool, new_pool = shm.SegmentPool(), shm.SegmentPool()
    big = torch.arange(2**20, dtype=torch.float32)  # 4 MiB: pooled
    old, new = shm.SharedMemoryTransport(pool=old_pool), shm.SharedMemoryTransport(pool=new_pool)
    earlier = wire.decode(
        old.fetch("00000000000000c0", 1, old.publish("00000000000000c0", 1, wire.encode(big)))
    )
    old_pool.close()  # (its segment is lent: it stays, retiring)
    assert old_pool.held()[0] == 1
    later = wire.decode(
        new.fetch("00000000000000c1", 1, new.publish("00000000000000c1", 1, wire.encode(big * 2)))
    )
    exact = torch.equal(earlier, big) and torch.equal(later, big * 2)
    del earlier, later  # (two notices to this process's socket: one for each pool's segment)
    new_pool.note_payload(big.nbytes, pooled=True)  # (a send reads the notices)
    assert exact
    assert old_pool.held() == (0, 0), "the closed pool's segment is given back once freed"
    assert [seg.busy for seg in new_pool.segments.values()] == [False], "its own is free again"
    new_pool.close()
    _empty_pools()


def _empty_pools() -> None:
    """Earlier tests' views are gone: hand their reports back, then release every pooled segment and kept map."""
    REPORTS.heed(1, REPORTS.take({PID: 1}))
    shm.release_shared_memory()
    assert shm.pooled_bytes() == (0, 0) and shm.kept_maps() == (0, 0)


def _publish_freed(transport: shm.SharedMemoryTransport, token: str, value: torch.Tensor) -> str:
    """Hand the receiver's freed reports back to this (sending) process, then publish ``value``."""
    REPORTS.heed(1, REPORTS.take({PID: 1}))
    return transport.publish(token, 1, wire.encode(value))


def test_the_first_rank_keeps_a_small_segments_map_and_sees_the_senders_new_bytes() -> None:
    """The map of a pooled segment of at most 4 MiB is kept for its next payload, and shows the
    sender's new bytes (what the last payload's tensors wrote into it is overwritten)."""
    _empty_pools()
    transport = shm.SharedMemoryTransport(pool=True)
    first = torch.arange(2**18, dtype=torch.float32)  # 1 MiB
    receipt = transport.publish("00000000000000d0", 1, wire.encode(first))
    assert receipt.startswith("p:")
    got = wire.decode(transport.fetch("00000000000000d0", 1, receipt))
    assert torch.equal(got, first) and shm.kept_maps() == (0, 0), "lent: not kept while viewed"
    got.fill_(-1.0)  # the receiver may write into its tensors (nobody else reads the segment meanwhile)
    del got
    assert shm.kept_maps()[0] == 1, "its views gone, the map is kept"
    again = _publish_freed(transport, "00000000000000d1", first * 3)
    assert again == receipt, "the same warm segment, so the kept map serves it"
    got = wire.decode(transport.fetch("00000000000000d1", 1, again))
    assert shm.kept_maps() == (0, 0), "taken from the kept maps"
    assert torch.equal(got, first * 3), "the sender's new bytes, not what the receiver wrote"
    # A smaller payload in the same segment is lent from the same map, exactly its length.
    del got
    smaller = _publish_freed(transport, "00000000000000d2", first[:20000])
    assert smaller.split(":")[2] == receipt.split(":")[2]
    assert torch.equal(wire.decode(transport.fetch("00000000000000d2", 1, smaller)), first[:20000])
    # Released, nothing is kept: neither what was kept nor what is lent now.
    held = wire.decode(transport.fetch("00000000000000d2", 1, smaller))
    shm.release_shared_memory()
    del held
    assert shm.kept_maps() == (0, 0)
    _empty_pools()


def test_a_big_segments_map_is_kept_while_its_sender_holds_the_segment() -> None:
    """A map of a segment over 4 MiB is kept too, its page tables filled, for the segment's next payload
    (a smaller one finds the first one's pages mapped: a fresh map fills only the payload's); it is watched
    from its first lending, a forked child forgets it, and it is given up at the first look after its
    sender lets the segment go."""
    import ctypes

    from distribute_utils.owners import owned, process_owned

    _empty_pools()
    pool = shm.SegmentPool()
    transport = shm.SharedMemoryTransport(pool=pool)
    big = torch.arange(shm.KeptMaps.MAX_BYTES // 4 + 2**18, dtype=torch.float32)  # 5 MiB
    receipt = transport.publish("00000000000000e0", 1, wire.encode(big))
    assert receipt.startswith("p:")
    keeper = owned(shm.KeptMaps)
    got = wire.decode(transport.fetch("00000000000000e0", 1, receipt))
    assert torch.equal(got, big) and shm.kept_maps() == (0, 0), "lent: not kept while viewed"
    assert process_owned(shm.BigSegmentWatch).watching(keeper), "watched from its lending"
    assert keeper.drop_idle(), "lent: still held"
    del got
    segment_bytes = pool.held()[1]
    assert shm.kept_maps() == (1, segment_bytes), "its views gone, the big map is kept"
    assert keeper.drop_idle(), "its sender holds the segment: kept"
    smaller = big[: 2**18]  # 1 MiB, pooled, in the same segment
    again = _publish_freed(transport, "00000000000000e1", smaller * 3)
    assert again.split(":")[2] == receipt.split(":")[2], "the same warm segment"
    buf = transport.fetch("00000000000000e1", 1, again)
    assert shm.kept_maps() == (0, 0), "taken from the kept maps"
    mapped = _rss_of_map_at(ctypes.addressof(buf))
    assert mapped >= big.nbytes, f"the kept map's pages ({mapped} bytes mapped), not a fresh map's"
    assert torch.equal(wire.decode(buf), smaller * 3), "the sender's new bytes"
    del buf
    assert shm.kept_maps()[0] == 1
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.write(write, repr(shm.kept_maps()).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 100) == b"(0, 0)", "a forked child forgets its copies of the maps"
    os.close(read)
    assert os.waitpid(child, 0)[1] == 0
    assert shm.kept_maps() == (1, segment_bytes), "the parent's are untouched"
    REPORTS.heed(1, REPORTS.take({PID: 1}))
    assert pool.release() == segment_bytes, "the sender lets its segment go"
    # Its next payload comes in a new segment: the map of the one it let go is given up as it is fetched.
    other = transport.publish("00000000000000e2", 1, wire.encode(big * 5))
    assert other.split(":")[2] != receipt.split(":")[2], "a new segment"
    got = wire.decode(transport.fetch("00000000000000e2", 1, other))
    assert shm.kept_maps() == (0, 0) and torch.equal(got, big * 5), "the let-go segment's map is gone"
    del got
    assert shm.kept_maps() == (1, pool.held()[1]), "the new segment's map is kept"
    REPORTS.heed(1, REPORTS.take({PID: 1}))
    assert pool.release() == segment_bytes
    assert not keeper.drop_idle() and shm.kept_maps() == (0, 0), "the map goes at the next look"
    _empty_pools()


def test_the_watch_starts_again_after_a_failed_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """A look that raises ends the watch's thread without leaving it marked running, so the next thing
    to watch starts it again (else big maps would stay until exit)."""
    import threading
    import time

    monkeypatch.setattr(shm.SegmentPool, "KEEP_S", 0.02)  # (a tunable bound: a look every 10 ms)
    watch = shm.BigSegmentWatch()

    class FailsOnce:
        def __init__(self) -> None:
            self.looks = 0
            self.looked_again = threading.Event()

        def drop_idle(self) -> bool:
            self.looks += 1
            if self.looks == 1:
                raise RuntimeError("a look that fails")
            self.looked_again.set()
            return False

    holder = FailsOnce()
    watch.watch(holder)
    deadline = time.monotonic() + 30
    while watch.running and time.monotonic() < deadline:
        time.sleep(0.01)  # (the thread's own period)
    assert not watch.running and holder.looks == 1, "the failed look ended the thread"
    watch.watch(holder)
    assert holder.looked_again.wait(30), "started again, it looks again"


def test_kept_small_maps_are_bounded() -> None:
    _empty_pools()
    kept = shm.KeptMaps()
    maps = [shm.SegmentMap(mmap_of(2**20), 0, 2**20) for _ in range(kept.MAX_TOTAL_BYTES // 2**20 + 3)]
    for i, item in enumerate(maps):  # one segment each of many senders
        kept.keep((i, "s"), item, kept.epoch)
    assert kept.held() == (64, 64 * 2**20), "least recently kept given up first"
    kept.keep((10, "s"), maps[10], kept.epoch)
    assert kept.held() == (64, 64 * 2**20), "kept again under its key: counted once"
    assert kept.take(0, "s", 0, 10) is None and kept.take(3, "s", 0, 10) is maps[3]
    assert kept.take(4, "s", 1, 10) is None, "another inode: not this map"
    assert kept.take(5, "s", 0, 2**20 + 1) is None, "a payload larger than the map"
    kept.keep((1, "x"), maps[0], kept.epoch - 1)
    assert kept.take(1, "x", 0, 10) is None, "lent before a release: not kept"
    kept.forget()
    for i, item in enumerate(maps[:5]):  # five segments of one sender: it never holds more than two at once
        kept.keep((7, str(i)), item, kept.epoch)
    assert kept.held() == (kept.PER_SENDER, kept.PER_SENDER * 2**20), "one sender: the last two"
    assert kept.take(7, "4", 0, 10) is maps[4] and kept.take(7, "2", 0, 10) is None
    _empty_pools()


def _rss_of_map_at(address: int) -> int:
    """Bytes of the mapping holding ``address`` that this process's page tables map (``/proc/self/smaps``)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_fresh_map_of_a_pooled_segment_has_exactly_the_payloads_pages_mapped() -> None:
    """A first rank's new map of a pooled segment has the payload's page tables
    filled as it is fetched, before anything reads it, and not the rest of the segment (a larger payload's
    tail: the kernel may map a fault-around window past the end, 64 KiB by default, never a MiB)."""
    import ctypes
    import mmap

    from distribute_utils.owners import owned

    _empty_pools()
    transport = shm.SharedMemoryTransport(pool=True)
    large = torch.ones((6 * 2**20) // 4)
    receipt = transport.publish("00000000000000f0", 1, wire.encode(large))
    del large
    wire.decode(transport.fetch("00000000000000f0", 1, receipt))  # (views gone at once)
    owned(shm.KeptMaps).forget()  # (the next payload is mapped anew)
    smaller = torch.ones((5 * 2**20) // 4)
    again = _publish_freed(transport, "00000000000000f1", smaller)
    assert again.split(":")[2] == receipt.split(":")[2], "the same 6 MiB segment"
    nbytes = int(again.split(":")[5])
    buf = transport.fetch("00000000000000f1", 1, again)
    mapped = _rss_of_map_at(ctypes.addressof(buf))
    try:
        mmap.mmap(-1, mmap.PAGESIZE).madvise(22)  # MADV_POPULATE_READ
    except OSError:  # a kernel before 5.14: the reader faults the pages in; nothing more to check
        assert mapped < nbytes
    else:
        paged = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        assert paged <= mapped < paged + 2**20, (mapped, nbytes)
    assert torch.equal(wire.decode(buf), smaller)
    del buf
    _empty_pools()


def mmap_of(nbytes: int) -> Any:
    import mmap

    return mmap.mmap(-1, nbytes)


def test_a_sender_copies_into_its_own_map_of_a_pooled_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new segment's first payload goes with ``pwrite`` (fresh pages); from the second on, no ``pwrite``:
    the sender maps the segment once, shared, and copies into it. The map closes with the segment, and a
    forked child holds neither."""
    pool = shm.SegmentPool()
    transport = shm.SharedMemoryTransport(pool=pool)
    big = torch.arange(2**20, dtype=torch.float32)
    first = transport.publish("00000000000000c0", 1, wire.encode(big * 2))
    seg = pool.segments[first.split(":")[2]]
    assert seg.mapped is None, "the first payload is written with pwrite"
    got = wire.decode(transport.fetch("00000000000000c0", 1, first))
    assert torch.equal(got, big * 2)
    del got

    def no_pwrite(*args: Any) -> None:
        raise AssertionError("a pooled payload was written with pwrite")

    monkeypatch.setattr(wire.payload, "pwrite_all", no_pwrite)  # where write_to_fd looks it up
    receipt = transport.publish("00000000000000c1", 1, wire.encode(big))
    assert receipt.split(":")[2] == seg.ident, "the same warm segment"
    assert seg.mapped is not None and len(seg.mapped) == seg.size
    got = wire.decode(transport.fetch("00000000000000c1", 1, receipt))
    assert torch.equal(got, big)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.write(write, repr((pool.held(), seg.mapped.closed)).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 100) == b"((0, 0), True)", "the child closed its copies of the segments"
    os.close(read)
    assert os.waitpid(child, 0)[1] == 0
    assert not seg.mapped.closed and pool.held() == (1, seg.size), "the parent's are untouched"
    del got
    assert pool.release() == seg.size
    assert seg.mapped.closed


def test_a_forked_child_lets_go_of_a_segment_a_parents_thread_was_copying_into() -> None:
    """Fork while another thread of the parent holds a view of a pooled segment's map (it was copying a
    payload in): the child cannot close that map (``BufferError``), but it still forgets the segment and
    closes its descriptor, and every other segment; the parent's pool is untouched."""
    pool = shm.SegmentPool()
    transport = shm.SharedMemoryTransport(pool=pool)
    tensor = torch.arange(2**18, dtype=torch.float32)
    first = transport.publish("00000000000000e0", 1, wire.encode(tensor))
    got = wire.decode(transport.fetch("00000000000000e0", 1, first))
    del got  # let go: the segment is free, and its next payload goes through the sender's map of it
    receipts = [transport.publish(f"00000000000000e{i}", 1, wire.encode(tensor)) for i in (1, 2)]
    busy, other = (pool.segments[receipt.split(":")[2]] for receipt in receipts)
    segments = [busy, other]  # the child meets the one in use first
    assert busy.mapped is not None and list(pool.segments.values()) == segments
    copying = memoryview(busy.mapped)  # what a copying thread holds while the fork happens
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        closed = []
        for seg in segments:
            try:
                os.fstat(seg.fd)
                closed.append(False)
            except OSError:
                closed.append(True)
        os.write(write, repr((pool.held(), closed, busy.mapped.closed)).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 200) == b"((0, 0), [True, True], False)", (
        "the child forgot both segments and closed their descriptors; the map in use stays open"
    )
    os.close(read)
    assert os.waitpid(child, 0)[1] == 0
    assert pool.held() == (2, sum(seg.size for seg in segments)), "the parent's pool is untouched"
    os.fstat(busy.fd)  # (still open in the parent)
    copying.release()
    pool.release()  # (busy segments go once freed: nobody fetched these)
    pool.freed({busy.ident, other.ident})
    assert busy.mapped.closed and pool.held() == (0, 0)


def test_a_sender_that_cannot_map_its_segment_writes_it_with_pwrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapping the segment fails (e.g. no address space left): the payload still goes, with pwrite."""
    pool = shm.SegmentPool()
    real_mmap = shm.mmap.mmap

    def no_sender_map(fd: int, length: int, flags: int = shm.mmap.MAP_SHARED, **kwargs: Any) -> Any:
        if flags & getattr(shm.mmap, "MAP_POPULATE", 0):  # the sender maps its segments with it
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(fd, length, flags=flags, **kwargs)

    monkeypatch.setattr(shm.mmap, "mmap", no_sender_map)
    transport = shm.SharedMemoryTransport(pool=pool)
    big = torch.arange(2**18, dtype=torch.int32)
    for i, token in enumerate(("00000000000000d0", "00000000000000d1")):  # the map is tried at the second
        receipt = transport.publish(token, 1, wire.encode(big + i))
        seg = pool.segments[receipt.split(":")[2]]
        assert seg.mapped is None, "no map: written with pwrite"
        got = wire.decode(transport.fetch(token, 1, receipt))
        assert torch.equal(got, big + i)
        del got
    assert len(pool.segments) == 1, "one warm segment, written twice"
    pool.release()


def test_pool_never_grows_a_sent_segment() -> None:
    """A payload larger than every free segment gets a new one (the smallest free one is closed):
    a first rank may keep the old one's map, which must never come to hold more pages."""
    pool = shm.SegmentPool()
    one, two = pool.take(2**20), pool.take(2 * 2**20)
    assert one is not None and two is not None
    pool.fit(one, 2**20, 1)
    pool.fit(two, 2 * 2**20, 1)
    pool.freed({one.ident, two.ident})
    grown = pool.take(3 * 2**20)
    assert grown is not None and grown.ident not in (one.ident, two.ident)
    pool.fit(grown, 3 * 2**20, 1)
    assert pool.held() == (2, 5 * 2**20), "the smallest free one was closed, the other kept as it was"
    assert set(pool.segments) == {two.ident, grown.ident} and os.fstat(two.fd).st_size == 2 * 2**20
    for seg in (two, grown):
        pool.discard(seg)


def test_pool_gives_the_best_fit_and_never_shrinks_a_segment() -> None:
    """A 64 MiB payload alternating with 16 MiB ones keeps its warm 64 MiB segment."""
    pool = shm.SegmentPool()
    large = pool.take(64 * 2**20)
    small = pool.take(16 * 2**20)
    assert large is not None and small is not None
    pool.fit(large, 64 * 2**20, 1)
    pool.fit(small, 16 * 2**20, 1)
    pool.freed({large.ident, small.ident})
    again = pool.take(16 * 2**20)
    assert again is small, "the smallest free segment that holds the payload"
    pool.fit(again, 15 * 2**20, 1)
    assert again.size == 16 * 2**20 and os.fstat(again.fd).st_size == 16 * 2**20, "never shrunk"
    big_again = pool.take(64 * 2**20)
    assert big_again is large and os.fstat(large.fd).st_size == 64 * 2**20
    for seg in (large, small):
        pool.discard(seg)


def test_a_pooled_payload_whose_sender_exited_is_reported_as_a_lost_peer() -> None:
    import subprocess
    import sys

    code = (
        "import os, sys, torch\n"
        "from distribute_utils import wire\n"
        "from distribute_utils.transports import shm\n"
        "t = shm.SharedMemoryTransport(pool=True)\n"
        "print(os.getpid(), t.publish('00000000000000c0', 1, wire.encode(torch.zeros(2**18))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    pid, receipt = int(out[0]), out[1]
    transport = shm.SharedMemoryTransport(pool=True)
    with pytest.raises(PeerLostError, match="rank 1 exited or gave up before its payload was read") as info:
        transport.fetch("00000000000000c0", 1, receipt)
    assert info.value.missing == (1,)
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.endswith(f"_{pid}")]


def _shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


def _pool_after_large_then_small() -> dict:
    """A 64 MiB gather, then small ones (inline, 4 KiB; as many as the pool looks back on): what each
    sender's pool holds."""
    import torch.distributed as dist

    from distribute_utils import get_tensors_parallel, release_shared_memory

    rank, ranks = dist.get_rank(), [0, 1]
    out: dict = {}
    with get_tensors_parallel(torch.full((16 * 2**20,), float(rank)), ranks) as got:
        if got:
            assert float(got[1][-1]) == 1.0
    del got  # the receiver's views go: its next verdict tells the sender
    out["after_large"] = shm.pooled_bytes()[1]
    for _ in range(shm.SegmentPool.RECENT_ANY):
        with get_tensors_parallel(torch.full((1024,), float(rank)), ranks):
            pass
    out["after_small"] = shm.pooled_bytes()[1]
    # The large segment again; then RECENT pooled payloads of 1 MiB give it back.
    with get_tensors_parallel(torch.full((16 * 2**20,), float(rank)), ranks) as got:
        assert not got or float(got[1][-1]) == 1.0
    del got
    out["large_again"] = shm.pooled_bytes()[1]
    for _ in range(shm.SegmentPool.RECENT):
        with get_tensors_parallel(torch.full((2**18,), float(rank)), ranks) as got:
            assert not got or float(got[1][-1]) == 1.0
        del got
    # The last 1 MiB payloads may have gone into the large segment (the smaller one still busy), whose
    # freed notice then comes after the last send looked: a segment is given back at a send, so one more
    # (inline) once the receiver's views are surely gone.
    dist.barrier()
    with get_tensors_parallel(torch.full((8,), float(rank)), ranks):
        pass
    out["after_pooled"] = shm.pooled_bytes()[1]
    with get_tensors_parallel(torch.full((4 * 2**20,), float(rank)), ranks):
        pass
    dist.barrier()
    before = _shmem_kib()
    out["released_at_once"] = release_shared_memory()  # its segment is still mapped by rank 0
    with get_tensors_parallel(torch.full((8,), float(rank)), ranks):
        pass  # this verdict tells the sender the receiver's views are gone: released then
    dist.barrier()
    out["shmem_drop_kib"] = before - _shmem_kib()
    out["after_release"] = shm.pooled_bytes()[1]
    return out


def _weights_between_scales() -> list[tuple[int, int]]:
    """ModelOpt's merges: a 4 MiB weight, then 20 small payloads that travel in the claim message (its
    scales: 8 bytes, and 100 KiB ones, above the pool's smallest), then the next 4 MiB weight: the
    sender's pooled (segments, bytes) after each step."""
    import torch.distributed as dist

    from distribute_utils import get_tensors_parallel

    rank, ranks = dist.get_rank(), [0, 1]
    held = []
    for step in range(2):
        with get_tensors_parallel(torch.full((2**20,), float(rank + step)), ranks) as got:
            assert not got or float(got[1][-1]) == 1.0 + step
        del got
        held.append(shm.pooled_bytes())
        for i in range(20):
            with get_tensors_parallel(torch.full((8,) if i % 2 else (25_600,), float(rank)), ranks):
                pass
        held.append(shm.pooled_bytes())
    return held


def test_small_payloads_between_weights_keep_the_weights_segment(fresh_job) -> None:
    """More payloads in claim messages than RECENT between two pooled ones (fewer than RECENT_ANY) leave
    the segment in the pool: the next weight is copied into it, warm (and, from a GPU, registered), not
    into a new one. (Before, 8 small ones pushed the 4 MiB segment out: every weight made a new one.)"""
    assert shm.SegmentPool.RECENT < 10 and shm.SegmentPool.RECENT_ANY > 20
    assert shm.SegmentPool.MIN_BYTES < 100 * 2**10 < ATTACHED_MAX_BYTES  # (the 100 KiB ones: see above)
    job = fresh_job(2)  # (a pool of its own: nothing else in it)
    held = job.run(_weights_between_scales, timeout=120)[1]
    assert held[0][0] == 1 and held[0][1] >= 4 * 2**20, held
    assert held == [held[0]] * 4, f"the sender's pool (segments, bytes) after each step: {held}"


def test_the_pool_gives_back_what_recent_rounds_do_not_need(pools) -> None:
    sender = pools.get(2).run(_pool_after_large_then_small, timeout=120)[1]
    assert sender["after_large"] >= 64 * 2**20, "the large payload was pooled"
    assert sender["after_small"] < 2**20, f"still holding {sender['after_small']} bytes after small rounds"
    assert sender["large_again"] >= 64 * 2**20, "the second large payload was pooled"
    assert sender["after_pooled"] < 8 * 2**20, f"still holding {sender['after_pooled']} after 1 MiB rounds"
    assert sender["after_release"] == 0, sender
    assert sender["shmem_drop_kib"] >= 8 * 1024, f"/proc/meminfo Shmem fell by {sender['shmem_drop_kib']} KiB"


def _rss_shmem_kib() -> int:
    """Shared memory this process maps and has touched (``RssShmem`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def _shm_mapped_bytes() -> int:
    """Bytes of ``/dev/shm`` files this process maps (``/proc/self/maps``), touched or not."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(shm.SHM_DIR + "/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                total += end - start
    return total


def _shm_mapped_in_a_forked_child() -> int:
    """:func:`_shm_mapped_bytes` of a child forked now (a DataLoader worker's case)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.write(write, str(_shm_mapped_bytes()).encode())
        os._exit(0)
    os.close(write)
    seen = int(os.read(read, 100))
    os.close(read)
    os.waitpid(child, 0)
    return seen


def _big_then_small_then_idle(keep_s: float) -> dict:
    """A 256 MiB gather, the first rank dropping its views, then KEEP_PAYLOADS + 1 small gathers; then
    another 256 MiB one and no send after it: what each rank holds and maps at each point."""
    import time

    import torch.distributed as dist

    from distribute_utils import get_tensors_parallel

    shm.SegmentPool.KEEP_S = keep_s  # (a tunable bound, as its docstring says: short for the test)
    rank, ranks = dist.get_rank(), [0, 1]
    big = torch.full((64 * 2**20,), float(rank))  # 256 MiB
    out: dict = {}
    for step in ("first", "second"):
        with get_tensors_parallel(big, ranks) as got:
            assert not got or float(got[1][-1]) == 1.0
        del got
        out[f"{step}_pooled"] = shm.pooled_bytes()[1]
        out[f"{step}_kept"] = shm.kept_maps()[1]
        if step == "first":
            out["mapped"], out["mapped_in_a_forked_child"] = (
                _shm_mapped_bytes(),
                _shm_mapped_in_a_forked_child(),
            )
            for _ in range(shm.SegmentPool.KEEP_PAYLOADS + 1):
                with get_tensors_parallel(torch.full((1024,), float(rank)), ranks):
                    pass
            out["after_small"] = shm.pooled_bytes()[1]
            out["rss_after_small_kib"] = _rss_shmem_kib()
    # (this gather's verdict carries the first rank's word that its views are gone, if no notice did)
    with get_tensors_parallel(torch.full((8,), float(rank)), ranks) as got:
        assert [float(t[0]) for t in got] == ([0.0, 1.0] if rank == 0 else [])
    deadline = time.monotonic() + 10 * keep_s + 30
    limit_kib = shm.SegmentPool.BIG_BYTES // 1024
    # (a map given up is unmapped once the watch thread's look, which still refers to it, has returned)
    while (
        max(shm.pooled_bytes()[1], shm.kept_maps()[1]) > shm.SegmentPool.BIG_BYTES
        or _rss_shmem_kib() >= limit_kib
    ):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)  # (the watch thread's own period is keep_s / 2)
    out["idle"] = shm.pooled_bytes()[1]
    out["kept_idle"] = shm.kept_maps()[1]
    out["rss_idle_kib"] = _rss_shmem_kib()
    dist.barrier()
    return out


def test_a_big_segment_is_given_back_once_unneeded_on_both_roles(fresh_job) -> None:
    """The stated bound (SegmentPool.BIG_BYTES): after a 256 MiB gather, a sender keeps its segment for
    at most KEEP_PAYLOADS sends that do not need it, or KEEP_S seconds when it sends no more; the first
    rank keeps its map of it between rounds (KeptMaps), only until its watch sees the sender let it go.
    (Before, 1 GiB stayed pooled until exit.)"""
    first, sender = fresh_job(2).run(_big_then_small_then_idle, 1.0, timeout=180)
    limit_kib = shm.SegmentPool.BIG_BYTES // 1024
    assert sender["first_pooled"] >= 256 * 2**20 and sender["second_pooled"] >= 256 * 2**20, sender
    assert sender["after_small"] <= shm.SegmentPool.BIG_BYTES, f"still pooled after small sends: {sender}"
    assert sender["idle"] <= shm.SegmentPool.BIG_BYTES, f"still pooled with no send for long: {sender}"
    assert sender["rss_after_small_kib"] < limit_kib and sender["rss_idle_kib"] < limit_kib, sender
    assert first["first_kept"] >= 256 * 2**20 and first["second_kept"] >= 256 * 2**20, "kept between rounds"
    assert first["mapped"] >= 256 * 2**20 > first["mapped_in_a_forked_child"], "a forked child unmaps them"
    assert first["kept_idle"] == 0 and first["rss_idle_kib"] < limit_kib, f"still mapped: {first}"
    assert first["after_small"] == first["idle"] == 0, "the first rank pooled nothing of its own"


def test_doctor_sees_unnamed_segments_held_open_and_release_gives_them_back() -> None:
    from distribute_utils import hygiene

    pool = shm.SegmentPool()
    seg = pool.take(4 * 2**20)
    assert seg is not None
    pool.fit(seg, 4 * 2**20, 1)
    held = [size for pid, size in hygiene.held_unnamed_files() if pid == PID]
    assert 4 * 2**20 in held, held
    assert pool.release() == 0, "a busy segment is not given back under its receiver"
    pool.freed({seg.ident})  # the receiver's views are gone: it goes now
    assert pool.held() == (0, 0)
    assert 4 * 2**20 not in [size for pid, size in hygiene.held_unnamed_files() if pid == PID]


def test_a_segment_whose_receiver_died_is_given_back() -> None:
    import subprocess
    import sys

    from distribute_utils.processes import this_process

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = this_process()
        receiver = type(me)(
            me.hostname, me.boot_id, me.shm_device, me.pid_namespace, child.pid, _start(child.pid)
        )
        pool = shm.SegmentPool()
        seg = pool.take(2**20)
        assert seg is not None
        pool.fit(seg, 2**20, 1)
        seg.receiver = receiver
        seg.looked -= pool.LOOK_EVERY_S  # due to be looked up (at most once a second: a /proc read)
        pool.note_payload(2**20, pooled=True)
        assert pool.held() == (1, 2**20), "busy under a live receiver: kept"
    finally:
        child.kill()
        child.wait()
    seg.looked -= pool.LOOK_EVERY_S
    pool.note_payload(2**20, pooled=True)
    assert pool.held() == (0, 0), "its receiver died: it will never be freed, so it goes"


def _start(pid: int) -> int:
    from distribute_utils.processes import pid_start_time

    return pid_start_time(pid)
