"""wire.LoneHead: a lone tensor's payload head kept for the next payloads gives the bytes encode gives and the
tensors decode gives, for exactly the values and payloads it may, and None for every other."""

from __future__ import annotations

import pytest
import torch

from distribute_utils import wire
from distribute_utils.wire import LoneHead, decode, encode

# (dtype, shape): sizes that are and are not multiples of the alignment, one and several dimensions, a scalar.
KINDS = [
    (torch.float32, (1024,)),
    (torch.float32, (3,)),
    (torch.bfloat16, (5, 7)),
    (torch.int64, ()),
    (torch.uint8, (2, 3, 4)),
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 100).to(dtype)


def _bytes(payload: wire.EncodedPayload) -> bytes:
    return b"".join(bytes(b) for b in payload.buffers())


@pytest.mark.parametrize(("dtype", "shape"), KINDS)
def test_a_kept_head_encodes_and_decodes_as_the_wire_does(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    first, second = _tensor(dtype, shape, 1), _tensor(dtype, shape, 2)
    made = encode(first, root="tensor")
    sender = LoneHead.of_payload(first, made)
    assert sender is not None
    behind = sender.bytes_of(second)  # (what a repeat sends behind the head, with no payload object)
    assert behind is not None
    again = sender.head + bytes(behind)
    assert len(again) == sender.nbytes == encode(second).nbytes
    assert again == _bytes(encode(second))  # the bytes encode makes, padding included
    carried = sender.payload(second)  # (what a repeat hands its host route, past the attached sizes)
    written = bytearray(carried.nbytes)
    carried.write_into(written)  # (as a pooled segment is written)
    assert carried.nbytes == sender.nbytes and _bytes(carried) == bytes(written) == again

    received = bytearray(_bytes(made))
    value = decode(received)
    receiver = LoneHead.of_decoded(received, value)
    assert receiver is not None
    message = bytearray(again)
    viewed = receiver.view(memoryview(message))
    decoded = decode(bytearray(message))
    assert viewed is not None and isinstance(decoded, torch.Tensor)
    assert viewed.dtype == decoded.dtype and viewed.shape == decoded.shape and torch.equal(viewed, second)
    start = torch.frombuffer(message, dtype=torch.uint8).data_ptr()
    assert start <= viewed.data_ptr() < start + len(message)  # a view of the message's bytes, no copy


def test_a_sender_encodes_anything_else_again() -> None:
    first = _tensor(torch.float32, (8, 4), 1)
    head = LoneHead.of_payload(first, encode(first))
    assert head is not None
    other = torch.zeros(8, 4)
    leaf = torch.zeros(8, 4, requires_grad=True)
    others = {
        "another dtype": other.double(),
        "another shape": other.reshape(4, 8),
        "not contiguous": torch.zeros(4, 8).t(),
        "a parameter": torch.nn.Parameter(other.clone()),
        "in autograd": leaf,
        "a conjugate's imaginary part": torch.zeros(8, 4, dtype=torch.complex64).conj().imag,
        # (contiguous, of the head's dtype and shape: only the lazy negation tells; torch makes such views
        # itself, e.g. inside conj().imag arithmetic, and has no public call that returns one)
        "negated lazily": torch._neg_view(torch.arange(32.0).reshape(8, 4)),
        "on the meta device": torch.empty(8, 4, device="meta"),
        "a config": {"w": other},
        "no tensor": 3.5,
    }
    for what, value in others.items():
        assert head.bytes_of(value) is None, what


def test_a_conjugated_tensor_is_encoded_again() -> None:
    z = torch.complex(torch.arange(32.0), torch.arange(32.0) + 1).reshape(8, 4)
    head = LoneHead.of_payload(z, encode(z))
    assert head is not None
    assert (
        head.bytes_of(z.conj()) is None
    )  # (contiguous, same dtype and shape: only the lazy conjugation tells)
    resolved = z.conj().resolve_conj()
    behind = head.bytes_of(resolved)
    assert behind is not None and head.head + bytes(behind) == _bytes(encode(resolved))


def test_only_a_plain_lone_tensor_payload_without_checksum_gives_a_head() -> None:
    t = torch.arange(16, dtype=torch.float32)
    assert LoneHead.of_payload(t, encode(t, checksum=True)) is None  # (a checksum differs every payload)
    assert LoneHead.of_payload({"w": t}, encode({"w": t})) is None
    assert LoneHead.of_payload(t, encode(t.clone())) is None  # (a payload of another tensor object)
    assert LoneHead.of_payload(torch.zeros(0), encode(torch.zeros(0))) is None  # (no bytes to send)


def test_a_receiver_decodes_every_other_payload_again() -> None:
    t = torch.arange(16, dtype=torch.float32)
    received = bytearray(_bytes(encode(t)))
    head = LoneHead.of_decoded(received, decode(received))
    assert head is not None
    same = bytearray(_bytes(encode(t + 1)))
    assert head.view(memoryview(same)) is not None
    others = {
        "another shape": bytearray(_bytes(encode(t.reshape(4, 4)))),
        "another dtype": bytearray(_bytes(encode(t.double()))),
        "longer": same + b"\0" * 64,
        "truncated": same[:-4],
        "a config": bytearray(_bytes(encode({"w": t}))),
    }
    for what, message in others.items():
        assert head.view(memoryview(message)) is None, what
    assert head.view(memoryview(bytes(same))) is None  # read-only: decode says what it does with those
    assert (
        head.view(same) is not None and head.view(memoryview(same).cast("I")) is not None
    )  # (any bytes-like)


def test_a_receiver_keeps_no_head_it_did_not_check_or_that_is_no_cpu_view() -> None:
    t = torch.arange(16, dtype=torch.float32)
    checked = bytearray(_bytes(encode(t, checksum=True)))
    assert LoneHead.of_decoded(checked, decode(checked)) is None  # (its checksum is read every time)
    config = bytearray(_bytes(encode({"w": t})))
    assert LoneHead.of_decoded(config, decode(config)) is None
    plain = bytearray(_bytes(encode(t)))
    assert LoneHead.of_decoded(plain, decode(plain).double()) is None  # (not what decode made of it)
    odd = torch.zeros(7, 1, 1, 991, dtype=torch.int16)  # (a head no other test decodes: its check is kept)
    unseen = bytearray(_bytes(encode(odd)))
    assert not wire.head_known(unseen)
    assert LoneHead.of_decoded(unseen, odd) is None  # (never decoded: nothing says its head was checked)
