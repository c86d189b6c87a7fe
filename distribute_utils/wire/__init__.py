"""Wire format: one self-describing byte string per rank per gather round.

A payload is a fixed 32-byte prefix, a msgpack header holding the config tree (with
tensors replaced by references) and one entry per tensor, then the raw tensor bytes,
each tensor at an offset that is a multiple of :data:`ALIGN` (64). The exact length is
known before anything is written, so shared-memory segments and files are sized
exactly. Decoding never unpickles and returns tensors that are zero-copy
``torch.frombuffer`` views of the caller's buffer. The full specification is
``docs/wire-format.md``; the byte-exact test in ``tests/test_wire.py`` pins it.

Typical use::

    payload = encode({"scale": 0.5, "w": weight}, checksum=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, payload.nbytes)              # sized exactly
    payload.write_to_fd(fd)                       # or payload.write_into(a writable buffer)
    ...
    config = decode(mmap.mmap(fd, payload.nbytes))  # on the reading rank: views of the map

The modules, each importing only those before it: :mod:`.format` (constants, prefix fields, dtype
table, shared helpers) <- :mod:`.payload` (:class:`EncodedPayload` and its writes) <-
:mod:`.encoding` (:func:`encode`); :mod:`.format` <- :mod:`.header` (prefix, header map, tensor
table checks) and :mod:`.tree` (the config tree's msgpack) <- :mod:`.decoding` (:func:`decode`);
:mod:`.payload` and :mod:`.decoding` <- :mod:`.lone` (:class:`LoneHead`: a lone tensor's head, kept).
This package re-exports their public names: use ``wire.X``.
"""

from __future__ import annotations

from .decoding import decode, decode_split, head_known, tensor_buffer, unusable_device
from .encoding import encode, nesting_error, unsupported_type_error
from .format import (
    ALIGN,
    DEFAULT_MAX_HEADER_BYTES,
    DTYPE_BY_NAME,
    EXT_BIGINT,
    EXT_DATACLASS,
    EXT_TENSOR,
    EXT_TUPLE,
    FLAG_CHECKSUM,
    MAGIC,
    MAX_DEPTH,
    PREFIX_SIZE,
    READABLE_VERSIONS,
    SOURCE_DEVICE,
    SUPPORTED_DTYPES,
    VERSION,
)
from .header import TABLE_BYTES_CONSTANT, TABLE_BYTES_PER_BYTE, PayloadPrefix, read_prefix, stated_length
from .lone import LoneHead
from .payload import EncodedPayload, as_uint8, pwrite_all

__all__ = [
    "ALIGN",
    "DEFAULT_MAX_HEADER_BYTES",
    "DTYPE_BY_NAME",
    "EXT_BIGINT",
    "EXT_DATACLASS",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "FLAG_CHECKSUM",
    "MAGIC",
    "MAX_DEPTH",
    "PREFIX_SIZE",
    "READABLE_VERSIONS",
    "SOURCE_DEVICE",
    "SUPPORTED_DTYPES",
    "TABLE_BYTES_CONSTANT",
    "TABLE_BYTES_PER_BYTE",
    "VERSION",
    "EncodedPayload",
    "LoneHead",
    "PayloadPrefix",
    "as_uint8",
    "decode",
    "decode_split",
    "encode",
    "head_known",
    "nesting_error",
    "pwrite_all",
    "read_prefix",
    "stated_length",
    "tensor_buffer",
    "unsupported_type_error",
    "unusable_device",
]
