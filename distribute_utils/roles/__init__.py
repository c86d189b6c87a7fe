"""Internal. One gather call, rank by rank: the round under :mod:`distribute_utils.gather`, as three roles.

:func:`~distribute_utils.gather.gather_on` checks the call's options, then makes this rank's part in the
call once, as the role the rank has in it; each role's main method reads top to bottom:

- :class:`~.sender.Sender` (``send``): a participant that does not receive;
- :class:`~.first_rank.FirstRank` (``receive``): its list's first rank, which receives;
- :class:`~.check_in.CheckIn` (``check_in``): a rank its own list does not name.

Shared by the three (:mod:`.part`): the checked list (:class:`~.part.RankList`), the claims and
verdicts ranks post, the channel, the records, the receiving carriers. Who sends to whom is the
:class:`~.plan.Plan`; the first rank's own value is placed by :mod:`.placing`. Dependencies point
one way: ``gather`` -> ``roles`` -> ``channel`` / ``transports`` / ``sync`` / ``wire``.

One call (:class:`distribute_utils.sync.Call`), one hop each way:

1. a sender encodes its value and publishes it through a carrier (see
   :mod:`distribute_utils.transports.base`): within a host the one :class:`~distribute_utils.transports.host.HostRoute`
   picks (inside the claim when small, else shared memory), across hosts the workspace or a collective;
   then sends its claim (list digest, transport, local error, ``[token, receipt]``) and waits
   for one answer: its first rank's verdict.
2. the first rank reads only its own participants' claims, checks that they name the same list
   and transport and carry no error, fetches each payload from the carrier its receipt names
   (:class:`~distribute_utils.transports.carriers.Receiving`; the receipt stays unread), decodes it (zero-copy; in a
   direct round as each claim comes, so that only the last one's payload is left when it comes), and
   sends its verdict (with the carriers' notes for its senders, :data:`~distribute_utils.transports.carriers.reports`).
   Any disagreement or error ends up in the verdict, so every rank of that gather raises, and nobody
   waits for a rank that will not come.
3. a sender releases what it published as soon as it has the verdict.

Claims and verdicts travel through a channel (:mod:`distribute_utils.channel`), one of two, chosen
alike by every participant from where the list's ranks run (:meth:`.part.Part.decide`; a sender reads
its first rank's info for it, the first rank its participants'):

- **direct round** (every rank of the list on this host, in one pid and network namespace,
  transport ``auto`` or ``shm``): through the ranks' mailboxes (:mod:`distribute_utils.mailbox`),
  nothing in the store; payloads up to 288 KiB inside the claim. A rank waiting past the grace
  checks its partners' pids and asks them what they do in this call; each rank remembers its
  part (:meth:`.part.Part.record`) and answers from a thread of its own, so a rank that does
  something else (another list, another transport) is named within a fraction of a second.
- **store round** (otherwise): keys in the group's namespace. A sender posts its claim
  ``c/<rank>`` and waits for ``v/<first>``; the first rank posts its own claim ``c/<first>``
  and its verdict ``v/<first>``. A rank that wrongly takes a sender for its receiver hears why
  from the watchdog within about a second: it reads that rank's claim and posts what stands for its
  verdict (:func:`.part.stand_in`). A rank of a direct round that fails posts the same keys,
  so that a partner that went through the store hears it there.

Senders on another host than the first rank wait for its plan (``plan``): the first
participant on each remote host collects its host's payloads and forwards one bundle.

A call like this rank's last one of the same list and options that went well in a direct round, every
payload inside its claim, runs through that call's repeat (:mod:`.repeat`): the same messages in fewer
steps; anything unlike it is taken over by the general role.
"""

from __future__ import annotations

from .check_in import CheckIn
from .first_rank import FirstRank
from .part import ATTACHED_MAX_BYTES, Part, RankList, Round, error_of, raise_from
from .plan import Plan, make_plan
from .sender import Sender

__all__ = [
    "ATTACHED_MAX_BYTES",
    "CheckIn",
    "FirstRank",
    "Part",
    "Plan",
    "RankList",
    "Round",
    "Sender",
    "error_of",
    "make_plan",
    "raise_from",
]
