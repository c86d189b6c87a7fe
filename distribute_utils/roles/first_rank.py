"""Internal. The first rank's role in a gather call: read its senders' claims, fetch and decode, post the verdict.

:meth:`FirstRank.receive` reads top to bottom. It posts its own claim and record, works out where
received tensors go (:meth:`~FirstRank.placement`; a GPU target pins maps and is where CUDA IPC copies
to) and the plan (:meth:`~FirstRank.plan_and_tell`, posted for senders on other hosts), places its own
value, then takes its senders' claims from the channel, each checked as it comes (on one host each
payload is fetched and decoded then too), lets collective senders send (:meth:`~FirstRank.tell_go`),
fetches and decodes what is left (a remote host's bundle part by part) and posts the verdict with the
carriers' notes for its senders. On any failure it tells every sender through the channel, keeps its
notes back and removes what senders published for it and it did not take.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from .. import wire
from ..channel import Buffer, MailboxChannel
from ..errors import DeviceUnavailableError, PayloadError, PeerLostError
from ..processes import process_alive
from ..transports import carriers
from ..transports.router import REQUESTS, Request, cross_carrier
from .part import Claim, Part, RankList, Round, Verdict, error_of, mismatch, not_direct, raise_from
from .placing import CPU, place_own
from .plan import Plan, make_plan

__all__ = ["FirstRank"]

logger = logging.getLogger(__name__)


class FirstRank(Part):
    """The rank that receives, in one gather call (see the module doc)."""

    def __init__(self, round_: Round, listed: RankList, *, received_on: str | None = None) -> None:
        super().__init__(round_, listed)
        self.received_on = received_on  # with device=None: where received config tensors go (see placement)

    # State that most calls never change (class defaults: nothing to set up per call).
    _go_posted = False
    _cross: str | None = None
    claims: dict[int, Claim] | None = None
    """Its senders' claims, once the verdict is made (what :mod:`.repeat` looks at)."""

    def receive(
        self, own: Any, device: str | torch.device | None, error: tuple[Any, ...] | None
    ) -> list[Any]:
        """The first rank: read its senders' claims, fetch and decode, post the verdict."""
        if error is None:
            own_claim = self.listed.kept(("first", self.mode), lambda: self.claim("first").pack())
        else:
            own_claim = self.claim("first", error).pack()
        self.channel.post_claim(own_claim)
        self.record("first")  # in a direct round, before waiting: a sender past the grace looks for it
        claims: dict[int, Claim] = {}
        found: dict[int, Any] = {}  # each rank's value (on one host, as its claim comes)
        taken: set[int] = set()  # whose payloads were fetched: nothing of theirs is left to discard
        plan: Plan | None = None
        notes: list[Any] = []
        try:
            if error is not None:
                raise_from(error, "")
            decode_to, own_to = self.placement(device)
            self.aim(decode_to)
            plan = self.plan_and_tell()
            direct = plan.direct
            # What needs no claim is done before they come: after the last one, only its own part is left.
            found[self.first] = place_own(own, own_to, self.root)
            notes = self.notes_for(self.ranks[1:])
            self.take_claims(direct, claims, decode_to, found if plan.cross is None else None)
            self.tell_go(None, claims)
            for rank in direct:
                if rank in found:  # decoded as its claim came
                    continue
                buffer = self.fetch(rank, claims[rank].body)
                taken.add(rank)
                host = plan.hosts.get(rank, ())
                if len(host) > 1:  # a remote host's bundle: its parts stay on the CPU until each is decoded
                    found.update(self.unbundle(rank, self.decode(buffer, rank, None), host, decode_to))
                else:
                    found[rank] = self.decode(buffer, rank, decode_to)
        except BaseException as exc:
            self.failed(exc, claims, found, taken)
            raise
        return self.conclude(notes, claims, found, direct)

    def aim(self, decode_to: torch.device | str | None) -> None:
        """Where received tensors are decoded to (:meth:`placement`) sets how the receiving carriers read."""
        self.pin_maps = self.pins(decode_to)
        if isinstance(decode_to, torch.device) and decode_to.type == "cuda":
            self._ipc_to = decode_to

    @staticmethod
    def pins(decode_to: torch.device | str | None) -> bool:
        """Whether the receiving carriers register their maps with CUDA (what they fetch is copied to a GPU):
        tensors are decoded to a device and CUDA is up in this process (it may come up later in a job)."""
        return decode_to is not None and torch.cuda.is_initialized()

    def take_over(
        self,
        channel: MailboxChannel,
        claims: dict[int, Claim],
        found: dict[int, Any],
        decode_to: torch.device | str | None,
        what: str,
    ) -> list[Any]:
        """A repeat (:mod:`.repeat`) recorded this call, placed this rank's value and took ``claims``
        (decoded into ``found``), then met something it does not do (what it read and did not take is
        back in the mailbox): take the other senders' claims and conclude as :meth:`receive` does."""
        self.adopt(channel, what)
        self.aim(decode_to)
        senders = self.ranks[1:]
        try:
            self.take_claims([r for r in senders if r not in found], claims, decode_to, found)
        except BaseException as exc:
            self.failed(exc, claims, found, set())
            raise
        return self.conclude([], claims, found, senders)

    def adopt(self, channel: MailboxChannel, what: str) -> None:
        """Take this call's ``channel`` from a repeat (:mod:`.repeat`): a give-up then goes to this call's
        store keys; ``what`` names the gather in messages as the repeat's did."""
        self.channel, self.what = channel, what
        channel.store = self.store_channel

    def failed(
        self, exc: BaseException, claims: dict[int, Claim], found: dict[int, Any], taken: set[int]
    ) -> None:
        """This call failed with ``exc``, ``claims`` taken (``found``, ``taken``: whose payloads were decoded,
        fetched): tell the partners what can still be told (a store that is gone cannot be: this error
        says more); what this rank keeps back and what senders published go whatever happens."""
        with contextlib.suppress(PeerLostError):
            self.tell_go(error_of(exc), claims)
        failed = Verdict(True, self.shown, self.digest, error_of(exc)).pack()
        self.record("first", error_of(exc))  # (in a direct round, a sender past the grace reads it)
        with contextlib.suppress(PeerLostError):
            self.channel.give_up(
                self.claim("first", error_of(exc)).pack(),
                failed,
                [rank for rank, claim in claims.items() if claim.error is not None],
            )
        self.take_back_notes()
        for rank, claim in claims.items():
            if rank not in taken and rank not in found:  # (found: fetched as its claim came)
                self.discard(rank, claim.body)
        self.remove_leftovers_of(getattr(exc, "missing", ()))

    def conclude(
        self, notes: list[Any], claims: dict[int, Claim], found: dict[int, Any], direct: list[int]
    ) -> list[Any]:
        """Every claim taken and every value in ``found``: post the verdict to ``direct`` (with this rank's
        ``notes`` and those in ``claims``); returns the values in list order."""
        self.claims = claims
        theirs = notes  # (this rank's own, kept back if the verdict cannot be posted)
        for claim in claims.values():  # (a loop, no comprehension's call: most claims carry no notes)
            if claim.notes:
                notes = notes + claim.notes
        # A sender may have received from this rank in an earlier gather (other roles, other numbers).
        if notes:
            carriers.reports.heed(self.me, notes)
        verdict = Verdict(True, self.shown, self.digest, None, notes).pack() if notes else self.listed.success
        try:
            self.channel.post_verdict(verdict, direct, self.what)
        except BaseException:
            if theirs:
                self.take_back_notes()
            raise
        return list(map(found.__getitem__, self.ranks))  # (each rank's value in list order, no Python call)

    def unbundle(
        self, leader: int, bundle: Any, host: Sequence[int], decode_to: torch.device | str | None
    ) -> dict[int, Any]:
        """The values in a remote host's bundle (forwarded by its leader, ``host`` its ranks by the plan),
        each decoded to ``decode_to``; a bundle that does not hold exactly one part per rank of ``host``
        is refused before anything of it is used."""
        ranks = bundle.get("ranks") if type(bundle) is dict else None
        parts = bundle.get("parts") if type(bundle) is dict else None
        if (
            ranks != list(host)
            or type(parts) is not list
            or len(parts) != len(host)
            or not all(isinstance(p, torch.Tensor) and p.dtype == torch.uint8 for p in parts)
        ):
            held = f"ranks {ranks!r:.80}" if isinstance(ranks, list) else "no ranks"
            raise PayloadError(
                f"the bundle of rank {leader}'s host holds {held} with "
                f"{len(parts) if isinstance(parts, list) else 'no'} parts (each must be a uint8 tensor); the "
                f"plan sends ranks {list(host)} "
                "through it (a leader that runs other code, or a corrupt payload)"
            )
        return {r: self.decode(wire.tensor_buffer(part), r, decode_to) for r, part in zip(host, parts)}

    def placement(
        self, device: str | torch.device | None
    ) -> tuple[torch.device | str | None, torch.device | None]:
        """The first rank: where received tensors are decoded to (for :func:`wire.decode`), and where its
        own value's tensors go (for :func:`.placing.place_own`; None: as passed). The rule is
        :func:`gather_to_first`'s."""
        if device is not None:
            target = torch.device(device)
            return (None if target.type == "cpu" else target), target
        if self.root == "tensor":
            return None, CPU
        return (self.received_on or wire.SOURCE_DEVICE), None

    def plan_and_tell(self) -> Plan:
        """Work out the plan; remote senders need it to know their route (posted when they exist)."""
        try:
            plan = self.plan()
        except BaseException as exc:
            if not self.request.flat:  # (flat senders wait for no plan)
                self.call.post_shared("plan", msgpack.packb([self.digest, list(error_of(exc)), None]))
            raise
        self._cross = plan.cross
        if plan.remote:
            self.call.post_shared("plan", msgpack.packb([self.digest, None, plan.pack()]))
        self.what = f"gather to rank {self.first} over {plan.description}"
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("round %s: %s", self.call.token, self.what)
        return plan

    def plan(self) -> Plan:
        """The route of this gather, worked out by the first rank from where ranks run (the same lists
        come back call after call: a route is kept for the incarnation, as are the infos it comes from)."""
        routes = self.companion.routes
        key = (tuple(self.ranks), self.request, self.workspace_path is not None)
        found = routes.get(key)
        if found is None:
            found = routes.put(key, self._plan_now())
        return found

    def _plan_now(self) -> Plan:
        if self.request.flat:
            return make_plan(self.request, self.ranks, {}, self.workspace_path is not None)
        directory = self.companion.directory
        assert directory is not None
        infos = directory.infos(self.ranks, self.companion.store, self.seconds, self.what)
        domains = {r: i.shm_domain for r, i in zip(self.ranks, infos)}
        return make_plan(self.request, self.ranks, domains, self.workspace_path is not None)

    def take_claims(
        self,
        senders: list[int],
        claims: dict[int, Claim],
        decode_to: torch.device | str | None,
        found: dict[int, Any] | None,
    ) -> None:
        """The first rank: its senders' claims from the channel, each checked as it comes (into ``claims``,
        so that a failure can discard what came). With ``found`` (every payload on this host: inline,
        attached or in a segment), each payload is fetched and decoded at once too (into ``found``): when
        the last claim comes, only its payload is left to read."""

        def take(rank: int, data: Buffer, attached: memoryview | None) -> None:
            try:
                claim = claims[rank] = Claim.unpack(data)
            except (ValueError, TypeError) as exc:
                raise PayloadError(f"rank {rank} sent a malformed claim: {exc}") from None
            if attached is not None:
                self._attached_in[rank] = attached
            self.check_claim(rank, claim)
            if found is not None:
                found[rank] = self.decode(self.fetch(rank, claim.body), rank, decode_to)

        if found is not None:
            self.receiving()  # (its carriers made while the claims are on their way, not at the first one)
        self.channel.claims(senders, self.what, self.judge_sender, take)

    def judge_sender(self, rank: int, entry: list[Any] | str | None) -> bool:
        """The first rank of a direct round, on a sender whose claim has not come: is it in this
        call (True), not yet (False), or doing something else (raises)?"""
        if entry is None:
            return False
        if isinstance(entry, str):  # "past"
            raise mismatch(self.me, self.shown, rank, None)
        kind, ranks, digest, mode, error, path = entry
        self.check_claim(rank, Claim(kind, ranks, digest, mode, error))
        if path != "direct":
            raise not_direct(self.me, rank)
        return True

    def tell_go(self, error: tuple[Any, ...] | None, claims: dict[int, Claim]) -> None:
        """Let senders whose carrier needs the first rank's "go" send (or tell them why not); once, only
        where some may wait (see :attr:`.base.Carrier.needs_go`)."""
        if self._go_posted or (error is None and self._cross is None and not self.request.needs_go):
            return  # (one host, nothing forced: nobody waits; no call for that, the common case)
        cross = cross_carrier(self._cross)
        go_here = self.request.needs_go or (cross is not None and cross.needs_go)
        if error is None and not go_here:
            return  # every claim was checked: they all asked for this rank's transport
        # Who waits for "go": by this rank's plan, or by its own request (the name in its claim's mode).
        waiting = any(c.body and (go_here or _asked(c.mode).needs_go) for c in claims.values())
        # A failed direct round cannot tell who waits: a sender that asked for such a carrier may.
        if waiting or (error is not None and (not self.channel.hears_all or go_here)):
            self.call.post_shared("go", msgpack.packb(list(error) if error else None))
            self._go_posted = True

    @staticmethod
    def decode(buffer: Any, rank: int, target: torch.device | str | None) -> Any:
        if isinstance(buffer, torch.Tensor) and buffer.device.type != "cpu" and _on_cpu(target):
            buffer = buffer.cpu()  # (a GPU buffer decodes to views there; these tensors go to the CPU)
        try:  # (only configs are decoded to their senders' devices: paths start at "config")
            return wire.decode(buffer, device=target)
        except PayloadError as exc:
            raise PayloadError(f"payload of rank {rank} is unusable: {exc}") from None
        except DeviceUnavailableError as exc:
            raise DeviceUnavailableError(f"rank {rank}'s {exc}") from None

    def remove_leftovers_of(self, ranks: Sequence[int]) -> None:
        """Senders that died before they could claim may have left a half-published payload (a named
        segment): remove those of dead processes on this host (their tokens were never told)."""
        directory = self.companion.directory
        for rank in ranks:
            info = directory.local_peers().get(rank) if directory is not None else None
            if info is not None and not process_alive(info):
                for path in carriers.remove_left_by(rank, info.pid):
                    logger.info("%s: removed %s, left by rank %d, which died", self.what, path, rank)


def _asked(mode: str) -> Request:
    """The request a claim's mode (``"<transport>:<has workspace>"``) names (unknown: as ``"auto"``)."""
    return REQUESTS.get(mode.partition(":")[0], REQUESTS["auto"])


def _on_cpu(target: torch.device | str | None) -> bool:
    """Whether :func:`wire.decode` with ``target`` leaves tensors on the CPU (None, or a CPU device)."""
    if target is None:
        return True
    if isinstance(target, str) and target == wire.SOURCE_DEVICE:
        return False
    return torch.device(target).type == "cpu"
