"""Internal. The CUDA driver API through ``ctypes`` (``libcuda.so.1``): the few calls the GPU carriers make.

Driver calls, not the runtime's: a failed runtime call (``cudaHostRegister`` of a range already
registered, say) stays as the runtime's "last error", and torch's next kernel launch reports it as its
own; a driver call's error is only its return value. Each call runs in a device's primary context (the
one torch uses), made current on the calling thread for the block (:meth:`Driver.context`).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import CudaError

__all__ = ["HANDLE_SIZE", "CudaError", "Driver", "IpcHandle", "driver"]

HANDLE_SIZE = 64  # CU_IPC_HANDLE_SIZE


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_SIZE)]

    def raw(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), HANDLE_SIZE)


class Driver:
    """The few CUDA driver calls the transports make (``libcuda.so.1``, loaded once: see :func:`driver`)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size, ptr, uint = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint
        pu64, pptr = ctypes.POINTER(u64), ctypes.POINTER(ptr)

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            return fn

        self.init = bind("cuInit", uint)
        self.device_get = bind("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self.retain = bind("cuDevicePrimaryCtxRetain", pptr, ctypes.c_int)
        self.release = bind("cuDevicePrimaryCtxRelease_v2", ctypes.c_int)
        self.push = bind("cuCtxPushCurrent_v2", ptr)
        self.pop = bind("cuCtxPopCurrent_v2", pptr)
        self.address_range = bind("cuMemGetAddressRange_v2", pu64, ctypes.POINTER(size), u64)
        self.get_handle = bind("cuIpcGetMemHandle", ctypes.POINTER(IpcHandle), u64)
        self.open_handle = bind("cuIpcOpenMemHandle_v2", pu64, IpcHandle, uint)
        self.close_handle = bind("cuIpcCloseMemHandle", u64)
        self.copy = bind("cuMemcpyDtoDAsync_v2", u64, u64, size, ptr)
        self.host_register = bind("cuMemHostRegister_v2", ptr, size, uint)
        self.host_unregister = bind("cuMemHostUnregister", ptr)
        self.error_string = bind("cuGetErrorString", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self.check(self.init(0), "cuInit")

    def check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.error_string(result, ctypes.byref(text))
            name = text.value.decode(errors="replace") if text.value else "unknown error"
            raise CudaError(f"{what} failed: CUDA driver error {result} ({name})")

    @contextlib.contextmanager
    def context(self, index: int) -> Iterator[None]:
        """Device ``index``'s primary context (torch's) current on this thread for the block."""
        device = ctypes.c_int()
        self.check(self.device_get(ctypes.byref(device), index), f"cuDeviceGet({index})")
        ctx = ctypes.c_void_p()
        self.check(self.retain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        try:
            self.check(self.push(ctx), "cuCtxPushCurrent")
            try:
                yield
            finally:
                self.pop(ctypes.byref(ctypes.c_void_p()))
        finally:
            self.release(device)


_driver: Driver | None = None
_lock = threading.Lock()


def driver() -> Driver:
    """The driver's calls, loaded on first use. Raises :class:`CudaError` when ``libcuda.so.1`` is missing
    or lacks them."""
    global _driver
    with _lock:
        if _driver is None:
            try:
                _driver = Driver()
            except (OSError, AttributeError) as exc:  # no libcuda.so.1, or one without these calls
                raise CudaError(f"the CUDA driver library cannot be used: {exc}") from None
        return _driver
