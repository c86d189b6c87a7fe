"""Internal. A repeat: a gather call like this rank's last one of the same list and options that went well,
run with what that call found out.

A job gathers the same list with the same options call after call (ModelOpt's export makes about 194
gathers, most of a few KiB), and a small gather's time is the Python each rank runs for it. When a call
goes well here in a direct round (every rank of the list on this host: :meth:`.part.Part.decide`), a
sender whose payload went inside its claim message, or through its host route to the first rank (a
shared-memory segment, a local-disk file or CUDA IPC, past the attached sizes), keeps a
:class:`SenderRepeat`, the first rank a :class:`FirstRepeat`, on the group's companion for the
incarnation, under the list and every option of the call (:func:`key`). The next call with that key
runs through it: the same messages, records and waits as the general path (:mod:`.sender`,
:mod:`.first_rank`), in fewer steps (a sender records its call before its claim goes, where the general
path records it after: a partner that asks in between hears that it sends in this call, which it does).
What it does not work out again, and why that is safe:

- the list's checks, the direct round's decision, the plan and the first rank's placement rule: each a
  function of the list, the options and where the ranks run, all fixed for the incarnation (the general
  path keeps them for the incarnation too);
- the carriers' objects: a payload inside the claim message needs none (a sender notes its size to the
  segment pool, which sizes itself by every payload, as the attached carrier does); one past the attached
  sizes goes through the host route a general call of the key made (:meth:`.sender.Sender.publish_here`),
  kept with its carriers: the route to the same first rank, whose process, and whether it may open this
  process's descriptors, are fixed for the incarnation. Its token is kept from payload to payload while
  no name is made of it (a pooled segment has none; the carrier says, :func:`.carriers.names_token`),
  and a fresh one follows a payload that was given one (a named segment, whose name other users can see:
  no token names two things, nor is used after it named one); the general path makes one per call. So a
  pooled segment sent again goes in the same claim bytes, which the first rank checks once; the first
  rank fetches such a payload through the carrier its receipt names, as the general path does,
  from a context kept for the key (the first rank, the timeout, the group, where tensors are decoded to);
  with a workspace, whose carrier is each call's own, neither role does;
- a claim's unpacking and checks, on the first rank, when its bytes are those of a claim it checked
  before: every check of a claim is a function of its bytes and of this rank's list and mode;
- a lone tensor's payload head (:class:`~distribute_utils.wire.LoneHead`): a sender whose last payload
  was one plain CPU tensor sends the next one of the same dtype and shape behind that payload's head
  (the bytes :func:`~distribute_utils.wire.encode` makes), inside its claim message or through its host
  route, and the first rank views a sender's payload
  whose head bytes and length are those of its last one, which it decoded (every check of a head is a
  function of its bytes; the length is checked every time).

Anything else goes the general way. Before anything is sent (notes to pass on, a carrier fault hook set,
a value that does not encode or place, a payload past :data:`~.part.ATTACHED_MAX_BYTES` with no host
route kept, or one the route fails to publish), the general path runs the call instead; a sender's repeat
learns the host route of such a call (:func:`sender_repeat`). After (no success heard within the grace,
a claim with notes, or whose payload is neither inside its message nor with a carrier of this host that
needs no "go", any error), and for an interrupt once the call is the repeat's (while it encodes or
publishes too), the role's general object takes the call over where the repeat is (``take_over``, or
``failed`` for an error, with what the repeat published), and the repeat is dropped.

Call order: :func:`key`, then the kept repeat's ``send`` / ``receive`` from ``gather``, inside the call
(its number taken, this rank's list checked, no error of its own).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .. import wire
from ..caches import Recent
from ..channel import Buffer, MailboxChannel
from ..liveness import GRACE_S
from ..mailbox import Line
from ..owners import owned
from ..transports import carriers
from ..transports.base import Context
from ..transports.inline import AttachedCarrier
from ..transports.segment_pool import SegmentPool
from .first_rank import FirstRank
from .part import ATTACHED_MAX_BYTES, Claim, RankList, Round
from .placing import place_own
from .sender import Sender, attached_claim, sender_claim

__all__ = ["FirstRepeat", "SenderRepeat", "first_repeat", "key", "sender_repeat"]

_CLAIMS_KEPT = 64  # distinct claims a first rank's repeat remembers as checked (sizes, senders' modes)


def key(
    round_: Round, listed: RankList, device: Any, received_on: str | None, world_size: int | None
) -> Hashable:
    """The call's key among its companion's repeats: the list and every option that changes a round (may
    hold an unhashable option: the caller finds out)."""
    _, _, asked, workspace_path, seconds, _, root = round_
    return (listed, asked.name, workspace_path, seconds, root, device, received_on, world_size)


class _Kept:
    """Where a repeat is kept (its companion's repeats, under its key): a failed or handed-over call drops it."""

    __slots__ = ("_at", "_key")

    def __init__(self, at: Recent[Any, Any], call_key: Hashable) -> None:
        self._at, self._key = at, call_key

    def drop(self) -> None:
        self._at.pop(self._key, None)


class SenderRepeat(_Kept):
    """A sender's repeat (see the module doc), made by :func:`sender_repeat`."""

    __slots__ = (
        "_claim",
        "_entry",
        "_line",
        "_listed",
        "_lone",
        "_me",
        "_mode",
        "_pool",
        "_root",
        "_route",
        "_routed",
        "_token",
    )

    def __init__(self, sender: Sender, at: Recent[Any, Any], call_key: Hashable) -> None:
        super().__init__(at, call_key)
        self._listed, self._mode, self._root, self._me = sender.listed, sender.mode, sender.root, sender.me
        self._entry = ["send", sender.shown, sender.digest, sender.mode, None, "direct"]  # (Part.record's)
        self._pool = owned(SegmentPool)
        self._route = sender.route  # (None: its payload went inside its claim message)
        self._lone: wire.LoneHead | None = None  # the head of its last payload, when that was one tensor
        # The parts before the payload of its last claim message, their length, and the payload size it states.
        self._claim: tuple[int, list[Buffer], int] = (-1, [], 0)
        self._line: Line | None = None  # (made at its first repeat)
        # The token of its last payload through the route, while no name was made of it (see the module doc),
        # and its last claim message there: the token and receipt it names, the message, its length.
        self._token: str | None = None
        self._routed: tuple[Any, list[Buffer], int] = (None, [], 0)

    def send(self, round_: Round, value: Any) -> bool:
        """This rank's part in ``round_``'s call (a sender's), as :meth:`Sender.send` does it; False when the
        call is no repeat: nothing was sent, the general path must run it. Whatever stops it after that
        (an interrupt while it encodes or publishes included) goes to a general :class:`Sender`, with what
        it published: what it published is released (but for an interrupt in the instant between a
        publish's return and its hand-over, as in the general path), and its partners hear its error when
        its claim had not gone yet (after, they hear what the first rank made of the claim, as in the
        general path).

        Its claim goes, and its verdict is read, through a line kept to the first rank
        (:meth:`MailboxChannel.claim_line`); the call's channel is made only when that line does not carry
        the round (it did not send, no success came within the grace, or anything raised)."""
        if carriers.reports.pending() or carriers.hooked():
            return False  # (notes to deliver, fault points to run)
        call = round_[1]
        sent: carriers.Sent | None = None
        message: list[Buffer] | None = None
        delivered = False
        channel: MailboxChannel | None = None  # (made only when the line does not carry the round)
        try:
            try:
                made = self._claim_of(value)
            except Exception:
                return False  # (the general path encodes it again, and posts the error to every partner)
            if made is None:
                return False
            message, nbytes, sent, _owner = made  # (_owner holds the bytes of message while it may be sent)
            call.record(self._entry)  # (before its claim goes: what a first rank past the grace reads)
            line = self._line
            if line is None:
                line = self._line = MailboxChannel.claim_line(round_[0], self._listed.first)
            delivered = line.send(call.number, message, nbytes)
            if delivered:
                heard = line.hear(call.number, self._listed.success, min(GRACE_S, round_[4]))
            else:
                channel = self._channel(round_, None, False)
                heard = channel.claim_and_hear(line, message, self._listed.success)
        except BaseException as exc:
            self.drop()
            sender = Sender(round_, self._listed)
            sender.adopt(channel or self._channel(round_, message, delivered), sent)
            sender.failed(exc, None)
            raise
        if heard:  # (released outside the guard, as the general sender concludes: the call went well)
            if sent is not None:
                sent.release(taken=True, answered=True)
            return True
        self.drop()
        Sender(round_, self._listed).take_over(channel or self._channel(round_, message, True), sent)
        return True

    def _channel(self, round_: Round, message: list[Buffer] | None, delivered: bool) -> MailboxChannel:
        """``round_``'s channel, for the general path: holding the claim ``message`` when it was ``delivered``
        (a channel that ran :meth:`MailboxChannel.claim_and_hear` holds what it sent itself)."""
        channel = MailboxChannel(round_[1], self._listed.ranks, round_[4], _no_store, ATTACHED_MAX_BYTES)
        if delivered and message is not None:
            channel.claimed(message)
        return channel

    def learn_route(self, sender: Sender) -> None:
        """``sender``, a call of this repeat's key that went the general way, published through its host
        route: the repeat's payloads past the attached sizes go that way from now on (see
        :func:`sender_repeat`)."""
        self._route = sender.route

    def _claim_of(self, value: Any) -> tuple[list[Buffer], int, carriers.Sent | None, Any] | None:
        """The claim message of ``value``'s payload (:meth:`MailboxChannel.claim_message`), its length, what was
        published for it, and what owns the bytes the message views (a payload's tensors, which the
        channel may send again); None when the repeat cannot send it (nothing published). Raises as
        encoding or publishing does, having published nothing (the general path then tries again)."""
        lone = self._lone
        # (a tensor like the last: its bytes go behind the last payload's head)
        data = lone.bytes_of(value) if lone is not None else None
        if lone is not None and data is not None:
            if lone.nbytes > ATTACHED_MAX_BYTES:
                return self._published(lone.payload(value))
            parts: Sequence[Buffer] = (lone.head, data)
            nbytes, owner = lone.nbytes, value
        else:
            payload = wire.encode(value, root=self._root, keep_device=True)
            self._lone = wire.LoneHead.of_payload(value, payload)
            if payload.nbytes > ATTACHED_MAX_BYTES:
                return self._published(payload)
            payload = payload.to_cpu()
            parts, nbytes, owner = payload.buffers(), payload.nbytes, payload
        self._pool.note_payload(nbytes, pooled=False)
        size, prefix, length = self._claim
        if size != nbytes:
            prefix, length = _sized(
                MailboxChannel.claim_message(attached_claim(self._listed, self._mode, nbytes), ())
            )
            self._claim = (nbytes, prefix, length)
        return [*prefix, *parts], length + nbytes, None, owner

    def _published(
        self, payload: wire.EncodedPayload
    ) -> tuple[list[Buffer], int, carriers.Sent, None] | None:
        """``payload``, past the attached sizes, through the host route of the call this repeat was made of
        (as :meth:`Sender.publish_here`), under the last payload's token while no name was made of it, else a
        fresh one (see the module doc); None when it has no route. A claim like the last one (its token and
        receipt) goes in the same message."""
        route = self._route
        if route is None:
            return None
        token = self._token or secrets.token_hex(8)
        self._token = None  # (a publish that fails may have made a name of it, and removed it)
        sent = route.publish(token, self._me, payload)
        if not carriers.names_token(sent.receipt):
            self._token = token
        made, message, length = self._routed
        if made != (token, sent.receipt):
            try:
                message, length = _sized(
                    MailboxChannel.claim_message(
                        sender_claim(self._listed, self._mode, [token, sent.receipt]), ()
                    )
                )
            except BaseException:
                sent.release(taken=False)
                raise
            self._routed = ((token, sent.receipt), message, length)
        return message, length, sent, None


class FirstRepeat(_Kept):
    """The first rank's repeat (see the module doc), made by :func:`first_repeat`."""

    __slots__ = (
        "_checked",
        "_checker",
        "_context",
        "_decode_to",
        "_entry",
        "_heads",
        "_listed",
        "_own_to",
        "_root",
        "_what",
    )

    def __init__(
        self, first: FirstRank, decode_to: Any, own_to: Any, at: Recent[Any, Any], call_key: Hashable
    ) -> None:
        super().__init__(at, call_key)
        self._listed, self._root, self._what = first.listed, first.root, first.what
        self._decode_to, self._own_to = decode_to, own_to
        self._entry = ["first", first.shown, first.digest, first.mode, None, "direct"]  # (Part.record's)
        self._checker = first  # (check_claim reads only what every call of this key shares)
        # What the receiving carriers of a payload past the attached sizes know (None: a workspace, whose
        # carrier is the call's own; such payloads then go the general way): the first rank, the timeout
        # and where tensors are decoded to, all fixed for the key, and the group, which the host's
        # carriers do not read; whether to pin maps, once CUDA is up; nothing arrives inside its claims.
        self._context: Context | None = None
        if first.workspace_path is None:
            self._context = dataclasses.replace(first.receiving().context, arrived={})
        # Claims checked before, by their bytes, with the payload size each states.
        self._checked: Recent[bytes, tuple[Claim, int]] = Recent(_CLAIMS_KEPT)
        # Each sender's last payload's head, when that payload was one tensor decoded to a CPU view of it.
        self._heads: dict[int, wire.LoneHead] = {}

    def receive(self, round_: Round, value: Any) -> list[Any] | None:
        """This rank's part in ``round_``'s call (the first rank's), as :meth:`FirstRank.receive` does it;
        None when the call is no repeat: nothing was sent, the general path must run it."""
        if carriers.reports.pending() or carriers.hooked():
            return None
        try:
            own = place_own(value, self._own_to, self._root)
        except Exception:
            return None  # (the general path places it again, and posts the error to every partner)
        listed = self._listed
        call = round_[1]
        call.record(self._entry)  # before waiting: a sender past the grace looks for it
        channel = MailboxChannel(call, listed.ranks, round_[4], _no_store, ATTACHED_MAX_BYTES)
        found: dict[int, Any] = {listed.first: own}
        claims: dict[int, Claim] = {}
        checked, decode_to, heads = self._checked, self._decode_to, self._heads
        receiving: list[carriers.Receiving] = []  # (made at the call's first payload past the attached sizes)

        def known(rank: int, data: memoryview, attached: memoryview) -> bool:
            raw = data.tobytes()
            seen = checked.get(raw)
            if seen is None:
                seen = self._check(rank, raw, claims)
                if seen is None:
                    return False
            claim, nbytes = seen
            claims[rank] = claim
            if nbytes >= 0:  # (inside the claim message)
                if attached.nbytes != nbytes:  # (as the attached carrier's fetch: the general path says it)
                    return False
                buffer: Any = attached
            else:  # (through the carrier its receipt names, as the general path fetches it)
                if not receiving:
                    context = self._context
                    assert context is not None  # (_check takes such a claim only with one)
                    if not context.pin and FirstRank.pins(decode_to):  # (CUDA came up since)
                        context = self._context = dataclasses.replace(context, pin=True)
                    receiving.append(carriers.Receiving(context))
                token, receipt = claim.body  # type: ignore[misc]  # (a list of two: checked by _check)
                buffer = receiving[0].fetch(token, rank, receipt)
            lone = heads.get(rank)
            # (a head like its last one; a carrier's GPU buffer is decoded)
            value = lone.view(buffer) if lone is not None and type(buffer) is not torch.Tensor else None
            if value is None:
                value = FirstRank.decode(buffer, rank, decode_to)
                lone = wire.LoneHead.of_decoded(buffer, value) if type(buffer) is not torch.Tensor else None
                if lone is not None:  # (None unless a CPU tensor came of it)
                    heads[rank] = lone
                elif rank in heads:
                    del heads[rank]
            found[rank] = value
            return True

        senders = listed.ranks[1:]
        try:
            left = channel.take_known(senders, known)
        except BaseException as exc:
            self.drop()
            first = FirstRank(round_, listed)
            first.adopt(channel, self._what)
            first.failed(exc, claims, found, set())
            raise
        if not left:
            channel.post_verdict(listed.success, senders, self._what)
            return list(map(found.__getitem__, listed.ranks))
        self.drop()
        return FirstRank(round_, listed).take_over(channel, claims, found, decode_to, self._what)

    def _check(self, rank: int, data: bytes, claims: dict[int, Claim]) -> tuple[Claim, int] | None:
        """``rank``'s claim, not seen before: checked as the general path checks it (raises as it does). A
        plain attached one is kept, with the size it states; one whose payload is with a carrier of this
        host that needs no "go" is taken (size -1), and kept when no name was made of its token (a sender's
        repeat sends a pooled segment again in the same claim bytes; any other token is fresh every call).
        None for any other: the general path takes it."""
        try:
            claim = Claim.unpack(data)
        except (ValueError, TypeError):
            return None  # (the general path says what is wrong with it)
        claims[rank] = claim
        self._checker.check_claim(rank, claim)
        if claim.notes:
            return None
        nbytes = _carried(claim.body, self._context is not None)
        if nbytes is None:
            return None
        if nbytes < 0 and carriers.names_token(claim.body[1]):  # type: ignore[index]  # (checked by _carried)
            return claim, nbytes  # (its token is fresh every call: not kept)
        return self._checked.put(data, (claim, nbytes))


def _carried(body: Any, routed: bool) -> int | None:
    """Where a claim's ``body`` says its payload is, for a first rank's repeat: the size it states when it is
    inside the claim message; -1 when it is with a carrier of this host that needs no "go" (only where
    ``routed``: the repeat fetches through such carriers); None for anything else (the general path)."""
    receipt = body[1] if type(body) is list and len(body) == 2 and type(body[0]) is str else None
    if type(receipt) is not list or len(receipt) != 2 or type(receipt[0]) is not str:
        return None
    if receipt[0] == AttachedCarrier.kind:
        size = receipt[1]
        return size if body[0] == "" and type(size) is int and size >= 0 else None
    carrier = carriers.KINDS.get(receipt[0])
    if not routed or carrier is None or carrier.scope != "host" or carrier.needs_go:
        return None
    return -1


def _sized(message: list[Buffer]) -> tuple[list[Buffer], int]:
    """A claim message of bytes (no payload attached yet) and its length."""
    return message, sum(map(len, message))


def _no_store() -> Any:
    raise AssertionError("a repeat's channel gives up only once a general role has adopted it")


def sender_repeat(
    sender: Sender, at: Recent[Any, Any], call_key: Hashable, kept: SenderRepeat | None
) -> None:
    """``sender``'s call, which went well the general way: keep a repeat of it in ``at`` under ``call_key``
    when it is one a repeat can run (a direct round, its payload inside its claim message or through its
    host route, with no workspace: the route's last carrier would be the call's own); or, where one is
    ``kept`` already (it could not run this call), let that one learn the host route."""
    if sender.channel.path != "direct":
        return
    routed = sender.route is not None and sender.workspace_path is None
    if kept is not None:
        if routed:
            kept.learn_route(sender)
    elif sender.attached or routed:
        at.put(call_key, SenderRepeat(sender, at, call_key))


def first_repeat(first: FirstRank, device: Any, at: Recent[Any, Any], call_key: Hashable) -> None:
    """Keep a repeat of ``first``'s call, which went well, in ``at`` under ``call_key``, when it is one a
    repeat can run: a direct round, every payload inside its claim message or, with no workspace, with a
    carrier of this host that needs no "go" (:func:`_carried`)."""
    claims = first.claims
    routed = first.workspace_path is None
    if (
        first.channel.path == "direct"
        and claims is not None
        and all(_carried(c.body, routed) is not None for c in claims.values())
    ):
        decode_to, own_to = first.placement(device)
        at.put(call_key, FirstRepeat(first, decode_to, own_to, at, call_key))
