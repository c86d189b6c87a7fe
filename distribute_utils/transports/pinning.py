"""Internal. Page-locking host memory for the CUDA runtime: a shared-memory map registered once, copied at pinned speed.

A copy between a GPU and pageable host memory goes through the driver's staging buffers (on an H100:
about 8.5 GiB/s device to host into an existing buffer, 5.3 host to device); the same copy from or into
memory registered with ``cudaHostRegister`` is a direct DMA (about 50 / 48 GiB/s). Registering costs
about as much as one such copy, so it is done once per map that is reused: a sender's pooled segment
(:mod:`.shm`), and a first rank's kept map of one that it copies to its GPU. Through the driver API
(``cuMemHostRegister``, :mod:`.cuda_driver`): a refused runtime call would linger as the runtime's last
error and fail torch's next kernel launch.

:class:`Registration` is the one handle: ``Registration.of(buffer)`` registers a writable buffer (an
``mmap``) and returns None where that cannot be done (no CUDA in this process, a limit on locked memory,
a driver that refuses): the copy then simply runs at pageable speed, logged at debug level, never an
error. ``close()`` unregisters, and must run before the buffer is unmapped; a forked child never calls
the CUDA runtime, so a registration made by its parent is forgotten there, not closed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..owners import process_owned
from .cuda_driver import CudaError, driver

__all__ = ["Registration", "Registrations", "registered_bytes"]

logger = logging.getLogger(__name__)


class Registrations(dict[int, int]):
    """This process's registrations: address -> bytes (see :func:`registered_bytes`); process-wide
    (``process_owned(Registrations)``): they belong to maps that may outlive a group."""


_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: pinned for every CUDA context of the process (every GPU)


class Registration:
    """``nbytes`` of host memory at ``address``, registered with the CUDA runtime by this process."""

    def __init__(self, address: int, nbytes: int, anchor: torch.Tensor, device_index: int) -> None:
        self.address, self.nbytes, self._index = address, nbytes, device_index
        self._anchor: torch.Tensor | None = anchor  # a view of the buffer: its address stays valid
        self._pid = os.getpid()

    @classmethod
    def of(cls, buffer: Any, nbytes: int) -> Registration | None:
        """Register the first ``nbytes`` of ``buffer`` (a writable shared map); None when CUDA is not in
        use in this process or refuses (then copies run at pageable speed)."""
        if nbytes <= 0 or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        anchor = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
        address, index = anchor.data_ptr(), torch.cuda.current_device()
        try:
            cuda = driver()
            with cuda.context(index):
                cuda.check(cuda.host_register(address, nbytes, _PORTABLE), "cuMemHostRegister")
        except CudaError as exc:
            logger.debug("%s (%d bytes): copies run at pageable speed", exc, nbytes)
            return None
        process_owned(Registrations)[address] = nbytes
        return cls(address, nbytes, anchor, index)

    def close(self) -> None:
        """Unregister (idempotent). Call it before the buffer is unmapped; a forked child only forgets."""
        if self._anchor is None:
            return
        self._anchor = None
        if os.getpid() != self._pid:
            return
        process_owned(Registrations).pop(self.address, None)
        try:
            cuda = driver()
            with cuda.context(self._index):
                cuda.check(cuda.host_unregister(self.address), "cuMemHostUnregister")
        except CudaError as exc:
            logger.debug("%s", exc)


def registered_bytes() -> tuple[int, int]:
    """``(registrations, bytes)`` this process holds registered with the CUDA runtime now: its pooled
    segments' maps as a sender and its kept maps as a first rank (:mod:`.shm`); after
    :func:`distribute_utils.release_shared_memory` only those of segments still in use."""
    live = process_owned(Registrations)
    return len(live), sum(live.values())
