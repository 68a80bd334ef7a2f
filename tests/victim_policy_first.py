"""A victim policy defined outside the package, for the tests of plugging one's own policy in."""

from __future__ import annotations

from typing import ClassVar

from tiered_kv.manager import Candidate, VictimPolicy


class FirstAdmittedPolicy(VictimPolicy):
    """The first admitted goes first: the opposite of vLLM's order (a higher rank is admitted later)."""

    name = "first_admitted"
    keyed: ClassVar[int] = 0  # candidates keyed by any instance: shows that a run used this policy

    def key(self, c: Candidate, mode: str) -> tuple[int]:
        type(self).keyed += 1
        return (c.rank,)


class NotAPolicy:
    """Has a key, but is no VictimPolicy."""

    def key(self, c: Candidate, mode: str) -> tuple[int]:
        return (c.rank,)
