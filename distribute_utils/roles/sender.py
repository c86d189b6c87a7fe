"""Internal. The sender's role in a gather call: publish, claim, wait for the verdict, release.

:meth:`Sender.send` reads top to bottom. A sender on its first rank's host (``my_plan`` is None)
encodes its value and attaches it to its claim when the channel takes it that way (a direct round,
up to :data:`~.part.ATTACHED_MAX_BYTES`), else publishes it through its host route
(:class:`~distribute_utils.transports.host.HostRoute`: the router's carriers by medium, cheapest first). On
another host it follows the plan its first rank posted: a host's leader collects its members' payloads
and forwards one bundle across (workspace or collective; a collective send waits for the first rank's
"go"), a member publishes to its leader. Then it posts its claim, waits for the verdict, releases
what it published and raises what the verdict says.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from .. import wire
from ..channel import MailboxChannel
from ..errors import PeerLostError
from ..transports import CollectiveTransport, carriers
from ..transports.base import Carrier, Route
from ..transports.collective import message_device
from ..transports.host import HostRoute
from ..transports.inline import AttachedCarrier
from ..transports.router import cross_carrier, host_route
from .part import (
    Claim,
    Part,
    RankList,
    Round,
    Verdict,
    error_of,
    mismatch,
    modes_differ,
    not_direct,
    raise_from,
)
from .plan import Plan, make_plan

__all__ = ["Sender", "attached_claim", "sender_claim"]


def sender_claim(listed: RankList, mode: str, body: list[Any]) -> bytes:
    """The packed claim of a sender of ``listed`` asking ``mode``, no error and no notes, its payload where
    ``body`` (``[token, receipt]``) says."""
    return Claim("send", listed.shown, listed.digest, mode, None, body).pack()


def attached_claim(listed: RankList, mode: str, nbytes: int) -> bytes:
    """:func:`sender_claim` with its ``nbytes`` payload inside its claim message: the same call after call
    (kept per size)."""
    return listed.kept(
        ("attached", mode, nbytes),
        lambda: sender_claim(listed, mode, ["", [AttachedCarrier.kind, nbytes]]),
    )


class Sender(Part):
    """A participant that does not receive, in one gather call (see the module doc)."""

    def __init__(self, round_: Round, listed: RankList, *, cuda_wanted: bool = False) -> None:
        super().__init__(round_, listed)
        # Its first rank likely wants tensors on a GPU (see gather.gather_on): CUDA IPC first (see host).
        self.cuda_wanted = cuda_wanted

    # State that most calls never change (class defaults: nothing to set up per call).
    _collective: dict[str, CollectiveTransport] | None = None  # made by the first collective send
    _relayed: list[Any] | None = None  # a leader: its members' notes, for the first rank's verdict
    _sent: carriers.Sent | None = None  # its publication, until released
    _attached: wire.EncodedPayload | None = None  # a direct sender's payload, in its claim message
    _deferred: tuple[str, wire.EncodedPayload] | None = None  # a collective send awaiting "go"
    route: HostRoute | None = None  # the host route its payload went through to its first rank (publish_here)

    def send(self, value: Any, error: tuple[Any, ...] | None) -> None:
        """A participant that does not receive: publish, claim, wait for the verdict, release."""
        try:
            if error is None:
                plan = None if self.channel.one_host else self.my_plan()
                if plan is None:
                    # A GPU's tensors go from there.
                    payload = wire.encode(value, root=self.root, keep_device=True)
                    if payload.nbytes <= self.channel.attach_max:
                        body = self.attach(payload)
                    else:
                        body = self.publish_here(payload)
                elif plan.leader_of(self.me) == self.me:
                    body = self.forward(plan, value)
                else:
                    body = self.publish_routed(
                        self.host(plan.leader_of(self.me)),
                        wire.encode(value, root=self.root, keep_device=True),
                    )
                # What this rank owes the other participants (segments it let go as a receiver or leader;
                # its members' notes). They travel on only in a successful verdict: see take_back_notes.
                notes = self.notes_for(self.ranks)
                if self._relayed:
                    notes = notes + self._relayed
                if self._attached is not None and not notes:
                    claim = attached_claim(self.listed, self.mode, self._attached.nbytes)
                else:
                    claim = self.claim("send", None, body, notes).pack()
            else:
                claim = self.claim("send", error).pack()
        except BaseException as exc:  # the first rank hears it at once instead of waiting for a claim
            self.take_back_notes()
            with contextlib.suppress(PeerLostError):  # (a store that is gone: this error says more)
                self.channel.give_up(self.claim("send", error_of(exc)).pack())
            self.record("send", error_of(exc))
            self.release(taken=False)
            raise
        self.conclude(self.claim_and_wait(claim, error))

    def conclude(self, verdict: Verdict | None) -> None:
        """Release what this sender published and raise what ``verdict`` says (None: the list's success)."""
        if verdict is None:  # (most calls: the success of this list, nothing to unpack or raise)
            self.release(taken=True, answered=True)
            return
        # A failed gather may never have read this payload: then nobody will report its segment free.
        succeeded = verdict.receiver and verdict.digest == self.digest and verdict.error is None
        self.release(taken=succeeded, answered=verdict.receiver and verdict.digest == self.digest)
        if not succeeded:
            self.take_back_notes()
        if not verdict.receiver or verdict.digest != self.digest:
            raise mismatch(self.me, self.shown, self.first, verdict.ranks)
        if verdict.notes:  # (most verdicts carry none: no call)
            carriers.reports.heed(self.me, verdict.notes)
        if verdict.error is not None:
            raise_from(verdict.error, f"the first rank ({self.first}) failed: ")

    def my_plan(self) -> Plan | None:
        """A sender's view: None when it sends straight to the first rank through this host."""
        if self.request.flat:
            return make_plan(self.request, self.ranks, {}, self.workspace_path is not None)
        key = ("first here", self.first)  # kept for the incarnation, as the infos it comes from
        here: bool | None = self.companion.routes.get(key)
        if here is None:
            directory = self.companion.directory
            assert directory is not None
            first = directory.info(self.first, self.companion.store, self.seconds, self.what)
            here = self.companion.routes.put(key, first.shm_domain == directory.me.shm_domain)
        if here:
            return None
        packed = self.call.wait_shared("plan", self.first, 2 * self.seconds, self.what)
        digest, error, plan = msgpack.unpackb(packed)
        if digest != self.digest:
            raise mismatch(self.me, self.shown, self.first, None)
        if error is not None:
            raise_from(error, "")
        return Plan.unpack(plan)

    # -- publishing ------------------------------------------------------------------------------
    def host(self, receiver: int) -> HostRoute:
        """A sender's route to ``receiver`` (on this host), as the router makes it (:func:`.router.host_route`):
        inline, CUDA IPC when it is the first rank and likely wants tensors on a GPU (``cuda_wanted``),
        shared memory, the local disk, the workspace."""
        directory = self.companion.directory
        assert directory is not None
        info = directory.info(receiver, self.companion.store, self.seconds, self.what)
        return host_route(
            self.request,
            info,
            pool=directory.me.can_watch(info),
            cuda=self.cuda_wanted and receiver == self.first,
            workspace=self._workspace_now if self.workspace_path is not None else None,
            what=self.what,
        )

    def publish_here(self, payload: wire.EncodedPayload) -> list[Any]:
        """A sender on its first rank's host, past the attached sizes: its host route (see :meth:`host`), kept
        as :attr:`route`."""
        self.route = self.host(self.first)
        return self.publish_routed(self.route, payload)

    def attach(self, payload: wire.EncodedPayload) -> list[Any]:
        """A direct round's sender: ``payload`` goes in its claim's message (see :data:`~.part.ATTACHED_MAX_BYTES`);
        returns the claim body (no token: nothing is named after it, and the claim may be kept)."""
        carrier = AttachedCarrier()
        self._sent = carriers.publish(carrier, "", self.me, payload)
        self._attached = carrier.outgoing
        return ["", self._sent.receipt]

    def publish(self, carrier: Carrier, payload: wire.EncodedPayload) -> list[Any]:
        """Publish this sender's ``payload`` through ``carrier``; returns the claim body."""
        token = secrets.token_hex(8)
        self._sent = carriers.publish(carrier, token, self.me, payload)
        return [token, self._sent.receipt]

    def publish_routed(self, route: Route, payload: wire.EncodedPayload) -> list[Any]:
        """Publish this sender's ``payload`` through the carrier ``route`` picks; returns the claim body."""
        token = secrets.token_hex(8)
        self._sent = route.publish(token, self.me, payload)
        return [token, self._sent.receipt]

    def forward(self, plan: Plan, value: Any) -> list[Any]:
        """A remote host's leader: collect its host's payloads and send one bundle across."""
        host = plan.hosts[self.me]
        flat = len(host) == 1
        cross = cross_carrier(plan.cross)
        assert cross is not None  # (a leader forwards across hosts)
        keep_device = flat and cross.devices == "keeps_gpu" and message_device(self.group, True) != "cpu"
        own = wire.encode(value, root=self.root, checksum=flat and cross.checksums, keep_device=keep_device)
        if flat:
            return self.publish_across(plan, own)
        others = host[1:]
        claims = [Claim.unpack(c) for c in self.call.wait_for("c", others, self.seconds, self.what)]
        self._relayed = [note for claim in claims for note in claim.notes or ()]
        try:
            for rank, claim in zip(others, claims):
                self.check_claim(rank, claim)
            mine = bytearray(own.nbytes)
            own.write_into(mine)
            parts = [torch.frombuffer(mine, dtype=torch.uint8)]
            for rank, claim in zip(others, claims):
                parts.append(torch.frombuffer(self.fetch(rank, claim.body), dtype=torch.uint8))
        except BaseException:
            for rank, claim in zip(others, claims):
                self.discard(rank, claim.body)
            raise
        bundle = {"ranks": [self.me, *others], "parts": parts}
        payload = wire.encode(bundle, root="bundle", checksum=cross.checksums)
        return self.publish_across(plan, payload)

    def publish_across(self, plan: Plan, payload: wire.EncodedPayload) -> list[Any]:
        """A leader (or flat sender): ``payload`` through the carrier across hosts; one that needs the
        first rank's "go" sends only then (a send cannot be taken back: see send())."""
        cross = cross_carrier(plan.cross)
        assert cross is not None
        if not cross.needs_go:
            return self.publish(self.workspace, payload)
        device = message_device(self.group, payload.device_resident)
        self._deferred = (device, payload.to_cpu() if device == "cpu" else payload)
        token = secrets.token_hex(8)
        self._sent = carriers.published(carriers.Sent(self.collective(device), token, device, self.me))
        return [token, self._sent.receipt]

    def collective(self, device: str) -> CollectiveTransport:
        """The collective carrier of this call to ``device`` (made once per call and device)."""
        if self._collective is None:
            self._collective = {}
        found = self._collective.get(device)
        if found is None:
            pg = self.group if self.group is None or isinstance(self.group, dist.ProcessGroup) else None
            found = self._collective[device] = CollectiveTransport(
                pg, self.first, self.seconds, torch.device(device)
            )
        return found

    # -- claiming and waiting --------------------------------------------------------------------
    def claim_and_wait(self, claim: bytes, error: tuple[Any, ...] | None) -> Verdict | None:
        """A sender: post its claim (with its payload when it is attached), send a deferred collective
        payload once the first rank says "go", and wait for the verdict (None: :attr:`RankList.success`).
        On any failure its partners are told what the channel can tell them (its failed claim) and what
        it published is released."""
        channel = self.channel
        try:
            channel.post_claim(claim, self._attached.buffers() if self._attached is not None else ())
            self.record("send", error)
            if error is not None:
                raise_from(error, "")
            if self._deferred is not None:
                self.send_deferred()
            found = channel.await_verdict(self.what, self.judge_first)
            return None if found == self.listed.success else Verdict.unpack(found)
        except BaseException as exc:
            self.failed(exc, error)
            raise

    def failed(self, exc: BaseException, error: tuple[Any, ...] | None) -> None:
        """Its claim posted (or not: ``channel.delivered``), this sender failed with ``exc`` (``error``:
        its own error, posted already): tell its partners what the channel can, release what it published."""
        channel = self.channel
        if not channel.delivered:  # the first rank never had the notes in this claim
            self.take_back_notes()
        error = error or error_of(exc)
        self.record("send", error)
        with contextlib.suppress(PeerLostError):  # (a store that is gone: this error says more)
            channel.give_up(self.claim("send", error).pack())
        self.release(taken=False)

    @property
    def attached(self) -> bool:
        """Whether its payload went inside its claim message (:meth:`attach`)."""
        return self._attached is not None

    def adopt(self, channel: MailboxChannel, sent: carriers.Sent | None = None) -> None:
        """Take this call's ``channel`` from a repeat (:mod:`.repeat`), which recorded the call and posted its
        claim (or failed before it went: ``channel.delivered``), its payload attached or published as
        ``sent`` (released as this sender's own); the channel holds the message for a resend. A give-up
        then goes to this call's store keys."""
        self.channel = channel
        channel.store = self.store_channel
        self._sent = sent

    def take_over(self, channel: MailboxChannel, sent: carriers.Sent | None = None) -> None:
        """A repeat posted this call's claim through ``channel`` (see :meth:`adopt`) but heard no success within
        the grace: wait for the verdict and conclude as :meth:`send` does."""
        self.adopt(channel, sent)
        try:
            found = channel.await_verdict(self.what, self.judge_first)
            verdict = None if found == self.listed.success else Verdict.unpack(found)
        except BaseException as exc:
            self.failed(exc, None)
            raise
        self.conclude(verdict)

    def send_deferred(self) -> None:
        """A collective sender, its claim posted: send its payload once the first rank says "go"."""
        assert self._deferred is not None and self._sent is not None
        device, payload = self._deferred
        self._deferred = None
        go = msgpack.unpackb(self.call.wait_shared("go", self.first, 2 * self.seconds, self.what))
        if go is not None:  # the first rank failed: its verdict will carry no notes
            self.take_back_notes()
            raise_from(go, f"the first rank ({self.first}) failed: ")
        self.collective(device).publish(self._sent.token, self.me, payload)

    def judge_first(self, rank: int, entry: list[Any] | str | None) -> bool:
        """A sender of a direct round, on its first rank whose verdict has not come (see :meth:`~.first_rank.FirstRank.judge_sender`)."""
        if entry is None:
            return False
        if isinstance(entry, str) or entry[0] != "first" or entry[2] != self.digest:  # str: "past"
            raise mismatch(self.me, self.shown, rank, None if isinstance(entry, str) else entry[1])
        mode, error, path = entry[3:]
        if error is not None:
            raise_from(error, f"the first rank ({rank}) failed: ")
        if mode != self.mode:
            raise modes_differ(self.me, self.mode, rank, mode)
        if path != "direct":
            raise not_direct(self.me, rank)
        return True

    def release(self, taken: bool, answered: bool = False) -> None:
        """Remove what this sender published, once its receiver is done (or gave up: ``taken=False``).
        ``answered``: a verdict came, so the receiver no longer reads (what frees CUDA IPC memory)."""
        if self._sent is not None:
            sent, self._sent = self._sent, None
            sent.release(taken, answered)
