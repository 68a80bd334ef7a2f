"""Layer 2: where KV lives.  The tier manager, copies in flight, pricing and victim policies.

The CPU store and the stores below it live beside the manager in :mod:`tiered_kv.tiers`.
"""

from tiered_kv.manager.bounded_log import BoundedLog
from tiered_kv.manager.manager_config import ManagerConfig
from tiered_kv.manager.metrics import LowerTierCounters, MetricsSnapshot, TierCounters
from tiered_kv.manager.outcomes import Admission, Completion, Decision, LoadDecision, Preemption, Resumption
from tiered_kv.manager.pricing import CostModel, LoadQuote, Quote
from tiered_kv.manager.states import PreemptMode, Residency
from tiered_kv.manager.tier_manager import TierManager
from tiered_kv.manager.victim_policy import (
    VICTIM_POLICIES,
    Candidate,
    CostAwarePolicy,
    LargestPolicy,
    LastAdmittedPolicy,
    PrefillAwarePolicy,
    VictimPolicy,
    get_victim_policy,
    register_victim_policy,
    select_victims,
)
from tiered_kv.transfer.plan import PlanKind

__all__ = [
    "VICTIM_POLICIES",
    "Admission",
    "BoundedLog",
    "Candidate",
    "Completion",
    "CostAwarePolicy",
    "CostModel",
    "Decision",
    "LargestPolicy",
    "LastAdmittedPolicy",
    "LoadDecision",
    "LoadQuote",
    "LowerTierCounters",
    "ManagerConfig",
    "MetricsSnapshot",
    "PlanKind",
    "PreemptMode",
    "Preemption",
    "PrefillAwarePolicy",
    "Quote",
    "Residency",
    "Resumption",
    "TierCounters",
    "TierManager",
    "VictimPolicy",
    "get_victim_policy",
    "register_victim_policy",
    "select_victims",
]
