"""Internal. The check-in role in a gather call: a rank its own list does not name.

Every rank of the group enters every gather call; one that its list does not name only checks in
(so that a rank that wrongly takes it for a sender or its receiver hears why instead of waiting) and
returns ``[]``. A rank whose list could not be checked checks in too, with its error, and raises.
"""

from __future__ import annotations

from typing import Any

from .part import Part

__all__ = ["CheckIn"]


class CheckIn(Part):
    """A rank that neither sends nor receives in one gather call (always through the store)."""

    def check_in(self, error: tuple[Any, ...] | None) -> None:
        """A rank its own list does not name: post a claim, and its record."""
        self.channel = self.store_channel()
        self.channel.post_claim(self.claim("none", error).pack())
        self.record("none", error)
