"""Internal. CUDA IPC transport: a sender's CUDA tensors copied device to device into the first rank's GPU.

For ranks of one host (one pid namespace) whose payload tensors are all on one CUDA device and whose
first rank wants them on a GPU. Nothing goes through host memory but the payload's head (its prefix
and header, a few KiB).

- **sender** (:meth:`CudaIpcTransport.publish`): waits for every queued kernel of the device
  (``torch.cuda.synchronize``: the bytes are final), then, per chunk, finds the ``cudaMalloc``
  allocation holding it (``cuMemGetAddressRange``) and takes that allocation's IPC handle
  (``cuIpcGetMemHandle``). The receipt is ``["cuda_ipc", head, nbytes, device, pid,
  [[offset, length, handle, inner, allocation_size], ...]]``: msgpack values only. The sender keeps
  the payload's chunk tensors referenced, so that the caching allocator cannot hand their memory
  to anything else, until :meth:`~CudaIpcTransport.release`.
- **first rank** (:meth:`CudaIpcTransport.fetch`): checks the receipt, allocates one flat ``uint8``
  buffer on its GPU, copies the head there, opens each distinct handle once
  (``cuIpcOpenMemHandle``), copies every chunk device to device (``cuMemcpyDtoDAsync`` on the
  current stream), synchronises the stream, and closes every mapping (``cuIpcCloseMemHandle``)
  before returning the buffer; :func:`distribute_utils.wire.decode` builds the tensors as views of it.

Why the driver API and not torch's storage handles (``UntypedStorage._share_cuda_``, as
``torch.multiprocessing.reductions.reduce_tensor`` uses): ``_share_cuda_`` replaces the sender's
storage's data pointer with a ref-counted one (an interprocess event and a slot in a
``/dev/shm/torch_<pid>_*`` counter file) that lives as long as the *user's* tensor, nested once per
share: gathering the same weights round after round grows without bound. Its memory is freed only
when the receiver's counter drops, so a receiver killed before it opened the handle leaves the
block in the sender's "limbo" until the sender exits, and a sender killed leaves its counter file
in ``/dev/shm``. Here the sender holds plain references for exactly one round and the CUDA driver
reclaims a dead process's allocations and mappings, so every path ends with nothing held:

- **success**: the first rank's mappings are closed before ``fetch`` returns (after the copies are
  synchronised); the sender drops its references in ``release`` once the verdict came.
- **an error in fetch** (malformed receipt, a handle that will not open, a failed copy): checked
  before anything is opened; what was opened is closed in ``finally``, after synchronising the
  stream; the sender, answered by a failed verdict, drops its references.
- **sender killed after publishing**: the driver frees its memory; the first rank's open fails and
  it raises :class:`~distribute_utils.errors.PeerLostError` naming the rank when the sender's pid
  is gone (:class:`~distribute_utils.errors.PayloadError` otherwise). There is no file to remove.
- **receiver killed before or while fetching**: the driver closes its mappings; the sender sees no
  verdict and calls ``release(taken=False)``: its receiver is dead (same pid and start time gone),
  so it drops its references at once.
- **receiver alive but silent** (the sender timed out, or failed before its answer came): it may
  still copy, so the references are kept (counted by :func:`stats` as ``held``) and dropped by a
  later ``publish`` or ``release`` of this process once that receiver has exited or answered a
  later round (it reads one round at a time). Nothing is ever freed under a live reader.

Assumptions: every rank of the host sees the same CUDA devices in the same order (the receipt
names the device by index); payloads allocated with ``expandable_segments`` or the
``cudaMallocAsync`` backend have no legacy IPC handle: ``publish`` raises
:class:`~distribute_utils.errors.TransportUnavailableError` and the gather falls back to shared memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from typing import Any

import torch

from ..errors import PayloadError, PeerLostError, TransportUnavailableError
from ..owners import process_owned
from ..processes import ProcessInfo, pid_alive, process_alive
from ..wire import ALIGN, EncodedPayload
from .base import Context, Destination
from .cuda_driver import HANDLE_SIZE, CudaError, Driver, IpcHandle
from .cuda_driver import driver as cuda_driver

__all__ = ["CudaIpcTransport", "IpcState", "is_receipt", "stats"]

logger = logging.getLogger(__name__)

KIND = "cuda_ipc"
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class IpcState:
    """This process's CUDA IPC payloads and counts; process-wide (``process_owned(IpcState)``): memory a
    first rank that did not answer may still read is kept until that process exits, whatever group
    comes next (see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = {"published": 0, "fetched": 0, "released": 0, "open": 0}
        # A sender's published payloads until release: (token, rank) -> the chunk tensors.
        self.held: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        # Payloads whose receiver did not answer, while it lives: (receiver, the chunk tensors).
        self.unsettled: list[tuple[ProcessInfo, tuple[torch.Tensor, ...]]] = []


def stats() -> dict[str, int]:
    """This process's CUDA IPC counts: payloads ``published`` (a sender), ``fetched`` (a first rank) and
    ``released``; mappings ``open`` now (0 outside a fetch) and payloads ``held`` now (published, not
    yet released, or released unanswered while their receiver lives; see the module doc)."""
    state = process_owned(IpcState)
    with state.lock:
        held = len(state.held) + len(state.unsettled)
        return {**state.counts, "held": held}


def is_receipt(receipt: Any) -> bool:
    """Whether ``receipt`` names this transport (its first item; see :func:`_parse` for the rest)."""
    return type(receipt) is list and len(receipt) == 6 and receipt[0] == KIND


class CudaIpcTransport:
    """Moves CUDA payloads between processes of one host by CUDA IPC (see the module doc);
    implements :class:`.base.Carrier` (kind ``"cuda_ipc"``).

    Args:
        receiver: the first rank's process (senders): tells in :meth:`release` whether it still lives.
        device: where :meth:`fetch` puts the buffer (the first rank; None: the device the sender's
            chunks are on, by index).
    """

    kind = KIND
    done_when_answered = True  # any verdict: the first rank no longer reads (see the module doc)
    scope = "host"  # (and the receiver in this pid namespace)
    medium = "gpu"
    max_bytes: int | None = None
    label = "CUDA IPC"
    devices = "keeps_gpu"
    needs_go = False
    checksums = False
    settings: tuple[str, ...] = ()

    def __init__(self, receiver: ProcessInfo | None = None, device: torch.device | str | None = None) -> None:
        self._receiver = receiver
        self._device = None if device is None else torch.device(device)

    @classmethod
    def receiving(cls, context: Context, rank: int, receipt: Any) -> CudaIpcTransport:
        """Copies to the GPU the round decodes to (else the sender's device, by index)."""
        return cls(device=context.device)

    @classmethod
    def sending(cls, destination: Destination) -> CudaIpcTransport:
        """Only to a receiver in this pid namespace (it opens this process's handles)."""
        if not destination.pool:
            raise TransportUnavailableError(
                "CUDA IPC is not used: the receiver runs in another pid namespace"
            )
        return cls(destination.receiver)

    @staticmethod
    def can_carry(payload: EncodedPayload) -> bool:
        """True when CUDA is available, the payload has at least one chunk and every chunk is a CUDA
        tensor on one device (never for CPU, meta or mixed payloads)."""
        chunks = payload.chunks
        if not chunks or not torch.cuda.is_available():
            return False
        device = chunks[0][1].device
        return device.type == "cuda" and all(t.device == device for _, t in chunks)

    # -- sender ------------------------------------------------------------------------------
    def publish(self, token: str, rank: int, payload: EncodedPayload) -> list[Any]:
        """Hand out IPC handles of ``payload``'s chunks; they stay referenced until :meth:`release`.

        Raises:
            TransportUnavailableError: the payload is not :meth:`can_carry`'s, or its memory has no
                IPC handle (``expandable_segments``, ``cudaMallocAsync``): the caller falls back.
        """
        if not self.can_carry(payload):
            where = sorted({str(t.device) for _, t in payload.chunks})
            raise TransportUnavailableError(
                f"CUDA IPC carries payloads whose tensors are all on one CUDA device; rank {rank}'s are on "
                f"{where or 'no device (no tensor bytes)'}"
            )
        _settle()
        device = payload.chunks[0][1].device
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(index)  # every queued write of these tensors is done before any reader
        entries: list[list[Any]] = []
        handles: dict[int, tuple[bytes, int]] = {}  # allocation base -> (handle, allocation size)
        try:
            driver = cuda_driver()
            with driver.context(index):
                for offset, tensor in payload.chunks:
                    pointer = tensor.data_ptr()
                    base, size = ctypes.c_uint64(), ctypes.c_size_t()
                    driver.check(
                        driver.address_range(ctypes.byref(base), ctypes.byref(size), pointer),
                        "cuMemGetAddressRange",
                    )
                    found = handles.get(base.value)
                    if found is None:
                        handle = IpcHandle()
                        driver.check(driver.get_handle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
                        found = handles[base.value] = (handle.raw(), size.value)
                    length = tensor.numel() * tensor.element_size()
                    entries.append([offset, length, found[0], pointer - base.value, found[1]])
        except CudaError as exc:
            raise TransportUnavailableError(f"rank {rank}'s CUDA memory has no IPC handle: {exc}") from None
        state = process_owned(IpcState)
        with state.lock:
            state.held[(token, rank)] = tuple(t for _, t in payload.chunks)
            state.counts["published"] += 1
        logger.debug(
            "rank %d published %d bytes on cuda:%d by CUDA IPC (%d chunks in %d allocations)",
            rank,
            payload.nbytes,
            index,
            len(entries),
            len(handles),
        )
        return [KIND, payload.head, payload.nbytes, index, os.getpid(), entries]

    def release(self, token: str, rank: int, receipt: Any = None, *, taken: bool = True) -> None:
        """Drop the references :meth:`publish` kept. ``taken``: the first rank answered (it copied the
        payload or gave it up); False with the first rank alive keeps them until it has exited."""
        del receipt
        state = process_owned(IpcState)
        with state.lock:
            chunks = state.held.pop((token, rank), None)
            if chunks is None:
                return
            state.counts["released"] += 1
            if not taken and self._receiver is not None and process_alive(self._receiver):
                state.unsettled.append((self._receiver, chunks))
                logger.warning(
                    "rank %d: its first rank (pid %d) did not answer and still runs; its CUDA payload stays "
                    "allocated until that process exits",
                    rank,
                    self._receiver.pid,
                )
        del chunks
        _settle(self._receiver if taken else None)

    # -- first rank ----------------------------------------------------------------------------
    def fetch(self, token: str, rank: int, receipt: Any) -> torch.Tensor:
        """``rank``'s payload as a flat ``uint8`` CUDA tensor of its length (copied device to device;
        every mapping closed before it returns).

        Raises:
            PayloadError: a malformed receipt, or memory that cannot be opened or copied.
            PeerLostError: the sender's process is gone, and its memory with it.
        """
        del token
        head, nbytes, index, pid, entries = _parse(receipt, rank)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = self._device if self._device is not None else torch.device("cuda", index)
        if device.index is None and count:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda" or device.index is None or max(index, device.index) >= count:
            raise PayloadError(
                f"rank {rank} published its payload on cuda:{index} by CUDA IPC, to be copied to {device}: "
                f"this process has {count} CUDA device(s)"
            )
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if head:
            buffer[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        try:
            driver = cuda_driver()
        except CudaError as exc:
            raise PayloadError(
                f"rank {rank}'s payload came by CUDA IPC, which this process cannot open: {exc}"
            ) from None
        stream = torch.cuda.current_stream(device)
        opened: dict[bytes, int] = {}
        try:
            with driver.context(device.index):
                for offset, length, handle, inner, _size in entries:
                    source = opened.get(handle)
                    if source is None:
                        source = opened[handle] = _open(driver, handle, rank, pid)
                    driver.check(
                        driver.copy(buffer.data_ptr() + offset, source + inner, length, stream.cuda_stream),
                        "cuMemcpyDtoDAsync",
                    )
                stream.synchronize()
        except CudaError as exc:
            raise PayloadError(
                f"rank {rank}'s payload could not be copied from its GPU memory: {exc}"
            ) from None
        finally:
            _close(driver, opened, stream, device.index)
        state = process_owned(IpcState)
        with state.lock:
            state.counts["fetched"] += 1
        logger.debug("fetched rank %d's %d bytes by CUDA IPC onto %s", rank, nbytes, device)
        return buffer

    def discard(self, token: str, rank: int, receipt: Any) -> None:
        """Nothing to remove: the first rank opens nothing outside :meth:`fetch`; the sender frees its own."""


def _open(driver: Driver, handle: bytes, rank: int, pid: int) -> int:
    """Map one IPC handle into the current context; a mapping that fails names the rank."""
    ipc = IpcHandle()
    ctypes.memmove(ctypes.addressof(ipc), handle, HANDLE_SIZE)
    pointer = ctypes.c_uint64()
    result = driver.open_handle(ctypes.byref(pointer), ipc, _LAZY_ENABLE_PEER_ACCESS)
    if result == 0:
        state = process_owned(IpcState)
        with state.lock:
            state.counts["open"] += 1
        return pointer.value
    if not pid_alive(pid):
        raise PeerLostError(
            f"rank {rank} (pid {pid}) exited after publishing its payload by CUDA IPC: its GPU memory "
            "went with it",
            [rank],
        )
    driver.check(result, f"cuIpcOpenMemHandle of rank {rank}'s memory")
    return 0  # never reached: check raised


def _close(driver: Driver, opened: dict[bytes, int], stream: torch.cuda.Stream, index: int) -> None:
    """Close every mapping of a fetch, once no copy from it can still run."""
    if not opened:
        return
    with contextlib.suppress(RuntimeError):
        stream.synchronize()
    with driver.context(index):
        for pointer in opened.values():
            result = driver.close_handle(pointer)
            state = process_owned(IpcState)
            with state.lock:
                state.counts["open"] -= 1
            if result != 0:
                logger.warning("cuIpcCloseMemHandle failed with CUDA driver error %d", result)
    opened.clear()


def _settle(answered: ProcessInfo | None = None) -> None:
    """Drop the payloads kept for receivers that did not answer and have exited since, or that have
    ``answered`` a later round (a first rank reads one round at a time: it is done with the earlier)."""
    state = process_owned(IpcState)
    with state.lock:
        if not state.unsettled:
            return
        gone = [entry for entry in state.unsettled if entry[0] == answered or not process_alive(entry[0])]
        for entry in gone:
            state.unsettled.remove(entry)
    if gone:
        logger.info("released %d CUDA payload(s) kept for first ranks that have exited", len(gone))


def _parse(receipt: Any, rank: int) -> tuple[bytes, int, int, int, list[list[Any]]]:
    """The checked fields of a receipt: every chunk lies within the payload (after the head) and within
    its sender's allocation; raises :class:`PayloadError` naming ``rank`` otherwise."""

    def bad(why: str) -> PayloadError:
        return PayloadError(f"rank {rank} published a malformed CUDA IPC receipt ({why}): {receipt!r:.120}")

    if not is_receipt(receipt):
        raise bad(f'expected ["{KIND}", head, nbytes, device, pid, chunks]')
    _, head, nbytes, index, pid, entries = receipt
    if type(head) is not bytes or not _whole(nbytes) or nbytes < len(head):
        raise bad("head must be bytes and nbytes an int of at least its length")
    if not _whole(index) or not _whole(pid) or type(entries) is not list or not entries:
        raise bad("device and pid must be ints >= 0, chunks a non-empty list")
    carried = len(head)
    for entry in entries:
        if type(entry) is not list or len(entry) != 5 or not all(_whole(v) for v in entry[:2] + entry[3:]):
            raise bad("each chunk is [offset, length, handle, inner offset, allocation size] of ints >= 0")
        offset, length, handle, inner, size = entry
        if type(handle) is not bytes or len(handle) != HANDLE_SIZE:
            raise bad(f"a handle must be {HANDLE_SIZE} bytes")
        if length == 0 or offset < len(head) or offset + length > nbytes or inner + length > size:
            raise bad(
                f"chunk of {length} bytes at {offset} (inner {inner}, allocation {size}) lies outside the "
                f"payload's {len(head)}..{nbytes} or its allocation"
            )
        carried += length + ALIGN  # (at most ALIGN - 1 bytes of padding before each chunk)
    if nbytes > carried:
        raise bad(f"nbytes {nbytes} is more than its head and chunks can fill")
    return head, nbytes, index, pid, entries


def _whole(value: Any) -> bool:
    return type(value) is int and value >= 0
