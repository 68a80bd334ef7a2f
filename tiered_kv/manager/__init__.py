"""Layer 2: where KV lives.  The tier manager, copies in flight, pricing and victim policies.

The CPU store and the stores below it live beside the manager in :mod:`tiered_kv.tiers`; their
names are re-exported here for the manager's users.
"""

from tiered_kv.manager.bounded_log import BoundedLog
from tiered_kv.manager.cost_model import DEFAULT_TIER_LINKS, CostModel, TierLink
from tiered_kv.manager.metrics import LowerTierCounters, MetricsSnapshot, TierCounters
from tiered_kv.manager.outcomes import Admission, Completion, Decision, LoadDecision, Preemption, Resumption
from tiered_kv.manager.pricing import LoadQuote, Quote
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
    select_victims,
)
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.store import BlockStore, LoadStoreSpec, LookupResult, PrepareStoreOutput, StoreEvent
from tiered_kv.transfer.plan import PlanKind

__all__ = [
    "DEFAULT_TIER_LINKS",
    "VICTIM_POLICIES",
    "Admission",
    "BlockStore",
    "BoundedLog",
    "CPUStore",
    "Candidate",
    "Completion",
    "CostAwarePolicy",
    "CostModel",
    "Decision",
    "LargestPolicy",
    "LastAdmittedPolicy",
    "LoadDecision",
    "LoadQuote",
    "LoadStoreSpec",
    "LookupResult",
    "LowerTierCounters",
    "MetricsSnapshot",
    "PlanKind",
    "PreemptMode",
    "Preemption",
    "PrefillAwarePolicy",
    "PrepareStoreOutput",
    "Quote",
    "Residency",
    "Resumption",
    "StoreEvent",
    "TierCounters",
    "TierLink",
    "TierManager",
    "VictimPolicy",
    "get_victim_policy",
    "select_victims",
]
