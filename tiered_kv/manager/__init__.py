"""Layer 2: the tier manager, victim policies and the swap/recompute cost model."""

from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.metrics import MetricsSnapshot, TierCounters
from tiered_kv.manager.policies import (
    POLICIES,
    CostAwarePolicy,
    LargestPolicy,
    LRUPolicy,
    PrefillAwarePolicy,
    VictimInfo,
    VictimPolicy,
    get_policy,
)
from tiered_kv.manager.states import PreemptMode, RequestState
from tiered_kv.manager.tier_manager import (
    AdmitResult,
    Completion,
    DecisionLogEntry,
    PreemptionResult,
    Quote,
    ResumeResult,
    TierManager,
    VictimDecision,
)

__all__ = [
    "POLICIES",
    "AdmitResult",
    "Completion",
    "CostAwarePolicy",
    "CostModel",
    "DecisionLogEntry",
    "LRUPolicy",
    "LargestPolicy",
    "MetricsSnapshot",
    "PreemptMode",
    "PreemptionResult",
    "PrefillAwarePolicy",
    "Quote",
    "RequestState",
    "ResumeResult",
    "TierCounters",
    "TierManager",
    "VictimDecision",
    "VictimInfo",
    "VictimPolicy",
    "get_policy",
]
