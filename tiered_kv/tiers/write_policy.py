"""When a tier's blocks are also written to the tier below it: one vocabulary for every hop.

The same three answers hold for the GPU -> CPU hop (the manager's ``offload``)
and for every hop below the CPU (a lower tier's ``write_policy``):

* ``"none"``: nothing is written down; a block evicted here is gone from here.
* ``"write_through"``: a block is written down as soon as it is stored here
  (for the GPU: a request's full prompt blocks, once computed).
* ``"write_back"``: a block is written down *ahead of its eviction*: the
  oldest blocks, those next to be evicted, are kept written below (for the
  GPU: the window at the front of the free queue; below the CPU: the tier's
  ``writeback_reserve`` least recent evictable blocks).  Eviction then finds
  blocks that the tier below already holds and never waits for a write.

Where the two hops differ, it is in mechanics, not meaning: a GPU block being
written down is held (no allocation can take it mid-copy) and given back in
place; a block below the CPU is pinned in its tier by the chain's move.
"""

from __future__ import annotations

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError

WRITE_POLICIES = ("none", "write_through", "write_back")

RENAMED = {"on_evict": "write_back"}
"""Old values and the name each has now; they are refused with that name, never accepted silently."""


def check_write_policy(name: str, value: object) -> str:
    """``value`` if it is one of :data:`WRITE_POLICIES`.

    Raises:
        InvalidArgumentError: an unknown value, or an old one (the message names the new one).
    """
    if value.__class__ is str and value in RENAMED:
        raise InvalidArgumentError(f"{name} must be one of {list(WRITE_POLICIES)}: {value!r} is now {RENAMED[value]!r}")
    return checks.choice(name, value, WRITE_POLICIES)  # type: ignore[no-any-return]
