"""Cache policies of the stores, one per module, as vLLM 0.33.0's ``kv_offload/cpu/policies/``."""

from tiered_kv.tiers.policies.arc import ARCPolicy
from tiered_kv.tiers.policies.base import CachePolicy, Predicate
from tiered_kv.tiers.policies.factory import (
    CACHE_POLICIES,
    get_cache_policy_cls,
    make_cache_policy,
    register_cache_policy,
)
from tiered_kv.tiers.policies.lru import LRUPolicy

__all__ = [
    "CACHE_POLICIES",
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "Predicate",
    "get_cache_policy_cls",
    "make_cache_policy",
    "register_cache_policy",
]
