"""Cache policies of a block store: which resident key to evict next.

A policy only orders keys and picks victims.  Slots, ref counts and the
pending/ready state belong to the store (one owner per fact): the store passes
them in as predicates, ``can_evict(key)`` to :meth:`CachePolicy.evict` and
``is_ready(key)`` to :meth:`CachePolicy.touch`.  Each policy is a small
subclass, and one contract test runs against all of them
(``tests/test_store_policies.py``).

The decisions follow vLLM's CPU offloading policies (``cpu/policies/lru.py``
and ``arc.py``), so that a store with a given policy evicts the same keys in the
same order as vLLM's ``CPUOffloadingManager`` would.
"""

from __future__ import annotations

from tiered_kv import checks
from tiered_kv.manager.store_arc import ARCPolicy
from tiered_kv.manager.store_lru import LRUPolicy
from tiered_kv.manager.store_policy import CachePolicy, Predicate

__all__ = ["CACHE_POLICIES", "ARCPolicy", "CachePolicy", "LRUPolicy", "Predicate", "make_cache_policy"]

CACHE_POLICIES: dict[str, type[CachePolicy]] = {cls.name: cls for cls in (LRUPolicy, ARCPolicy)}


def make_cache_policy(name: str, capacity: int) -> CachePolicy:
    """A new, empty policy by registry name (``"lru"`` or ``"arc"``)."""
    checks.choice("policy", name, CACHE_POLICIES)
    return CACHE_POLICIES[name](capacity)
