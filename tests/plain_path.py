"""A tier manager that reports nothing quiet: the scheduler's plain path, which its fast one is checked against.

The scheduler skips ``grow`` for a step that stays within the quiet tokens
of the manager's last answer to it (``TierManager.quiet_tokens``: a decode
token landing in a block the request holds, filling none).  Zero quiet
tokens is always a true answer (no step computes zero tokens), so with this
manager every scheduled request is allocated: the same decisions must
follow, event for event.
"""

from __future__ import annotations

from collections.abc import Hashable

from tiered_kv.manager import TierManager


class PlainPathTierManager(TierManager):
    """:class:`TierManager` whose ``quiet_tokens`` is always 0, so the scheduler never skips ``grow``."""

    def quiet_tokens(self, request_id: Hashable) -> int:
        return 0

    def grow(self, request_id: Hashable, num_new_tokens: int) -> int | None:
        return None if super().grow(request_id, num_new_tokens) is None else 0
