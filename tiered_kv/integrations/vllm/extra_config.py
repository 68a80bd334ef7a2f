"""What ``kv_connector_extra_config`` may hold for tiered_kv's vLLM plug-ins, checked before anything is built.

vLLM 0.33 reads its own keys from that dict and ignores every other one, so a
misspelled key (``"eviction_polcy": "arc"``, ``"load_pricng": {...}``) used to
give plain vLLM behaviour without a word.  Where tiered_kv's code is in charge
of the dict (its spec, its tiers under vLLM's tiering spec, its scheduler), an
unknown key is refused with the list of known ones: vLLM's own keys (those
vLLM 0.33.0's offloading connector, offloading config, CPU spec and tiering
spec read; listed below with where they are read) and tiered_kv's.

Also here: the ``preemption`` object read by the scheduler class
(:mod:`tiered_kv.integrations.vllm.scheduler`) and checked by the spec when vLLM
builds it, and the resolution of a victim policy from a name, a qualified class
name or an instance.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.errors import ConfigError, InvalidArgumentError
from tiered_kv.manager.pricing import CostModel
from tiered_kv.manager.states import MODES
from tiered_kv.manager.victim_policy import VICTIM_POLICIES, LastAdmittedPolicy, VictimPolicy, get_victim_policy

VLLM_OFFLOADING_KEYS = frozenset(
    {
        # vllm/v1/kv_offload/factory.py
        "spec_name",
        "spec_module_path",
        # vllm/v1/kv_offload/base.py (OffloadingSpec)
        "offload_prompt_only",
        "self_describing_kv_events",
        # vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py
        "blocks_per_chunk",
        "block_size",
        "canonical_layout",
        # vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py
        "sync_load_budget_bytes",
        # vllm/v1/kv_offload/cpu/spec.py
        "cpu_bytes_to_use",
        "eviction_policy",
        "cache_policy_module_path",
        "store_threshold",
        "max_tracker_size",
    }
)
"""Top-level keys vLLM 0.33.0 reads for an offloading connector over a CPU spec."""

VLLM_TIERING_KEYS = VLLM_OFFLOADING_KEYS | {
    # vllm/v1/kv_offload/tiering/spec.py
    "secondary_tiers",
    "tier_poll_interval_s",
    "backpressure",
}
"""Top-level keys vLLM 0.33.0 reads for its ``TieringOffloadingSpec``."""

TIERED_KV_KEYS = frozenset({"load_pricing", "preemption"})
"""Top-level keys tiered_kv's spec reads (``load_pricing``: :mod:`.spec`; ``preemption``: below)."""

PREEMPTION_KEYS = ("mode", "victim_policy", "cost_model")
COST_MODEL_KEYS = (
    "prefill_tokens_per_s",
    "prefill_quadratic_s_per_token2",
    "prefill_overhead_s",
    "d2h_bytes_per_s",
    "h2d_bytes_per_s",
    "per_copy_overhead_s",
    "kv_bytes_per_token",
)


def check_keys(where: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse keys of ``given`` that are not in ``known``, naming them, a near spelling and every known key.

    Raises:
        ConfigError: an unknown key (nothing has been built yet).
    """
    known = sorted(known)
    unknown = sorted(str(k) for k in set(given) - set(known))
    if not unknown:
        return
    hints = []
    for key in unknown:
        near = difflib.get_close_matches(key, known, n=1)
        if near:
            hints.append(f"{key!r}: did you mean {near[0]!r}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise ConfigError(f"{where}: unknown key(s) {unknown}{hint}; the known keys are {known}")


def resolve_victim_policy(value: Any, cost_model: CostModel | None = None) -> VictimPolicy:
    """The victim policy ``value`` stands for, as tiered_kv's own scheduler resolves one.

    A :class:`~tiered_kv.manager.victim_policy.VictimPolicy` instance, a name
    (built-in, or given to :func:`~tiered_kv.manager.victim_policy.register_victim_policy`
    in the process vLLM's scheduler runs in), or a subclass's qualified name
    ``package.module.ClassName`` (the form that reaches vLLM's engine process from
    the command line); from Python, also the class itself.  A named policy is
    built by its ``create(cost_model)``.

    Raises:
        ConfigError: anything else, naming the known policies (and a near spelling).
    """
    if isinstance(value, type) and issubclass(value, VictimPolicy) and value is not VictimPolicy:
        return value.create(cost_model)
    try:
        return get_victim_policy(value, cost_model)
    except InvalidArgumentError as exc:
        near = difflib.get_close_matches(value, sorted(VICTIM_POLICIES), n=1) if isinstance(value, str) else []
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"preemption.{exc}{hint}") from None


@dataclass(frozen=True)
class PreemptionConfig:
    """How the scheduler class preempts (the ``preemption`` object of ``kv_connector_extra_config``).

    Attributes:
        mode: ``"recompute"`` (vLLM's only mode, the default), ``"swap"`` (store each
            victim's computed KV to the CPU tier; a victim that cannot be swapped is
            recomputed, and its decision says why) or ``"auto"`` (per victim, by its
            :class:`~tiered_kv.manager.pricing.Quote`, as tiered_kv's own scheduler does).
        victim_policy: Who is preempted first; ``last_admitted`` is vLLM's own order.
        cost_model: Prices each victim's quote: swap against recompute.
    """

    cost_model: CostModel
    mode: str = "recompute"
    victim_policy: VictimPolicy = field(default_factory=LastAdmittedPolicy)

    @property
    def swaps(self) -> bool:
        """Whether any victim may be swapped (needs tiered_kv's connector)."""
        return self.mode != "recompute"


def preemption_config(raw: Any, kv_bytes_per_token: int, block_size: int) -> PreemptionConfig:
    """Parse and check the ``preemption`` object; ``None`` gives vLLM's behaviour (recompute, last admitted).

    Args:
        raw: The object from ``kv_connector_extra_config`` (or ``None``).
        kv_bytes_per_token: KV bytes of one token over all layers and ranks (from vLLM's
            KV cache config), unless the object's ``cost_model`` gives it.
        block_size: Tokens of one GPU block: the quote prices GPU blocks.

    Raises:
        ConfigError: an unknown key, a bad mode or policy, a cost model value that is
            not a number >= 0, or a missing prefill speed where a decision needs it.
    """
    if raw is None:
        return PreemptionConfig(CostModel(kv_bytes_per_token=kv_bytes_per_token, block_size=block_size))
    if not isinstance(raw, Mapping):
        raise ConfigError(f"preemption must be an object (keys {list(PREEMPTION_KEYS)}), got {raw!r}")
    check_keys("preemption", raw, PREEMPTION_KEYS)
    mode = raw.get("mode", "recompute")
    if mode not in MODES:
        raise ConfigError(f"preemption.mode: {mode!r} is not one of {list(MODES)}")
    costs = raw.get("cost_model")
    if costs is not None and not isinstance(costs, Mapping):
        raise ConfigError(f"preemption.cost_model must be an object (keys {list(COST_MODEL_KEYS)}), got {costs!r}")
    costs = dict(costs or {})
    check_keys("preemption.cost_model", costs, COST_MODEL_KEYS)
    given = "prefill_tokens_per_s" in costs
    costs.setdefault("kv_bytes_per_token", kv_bytes_per_token)
    try:
        cost_model = CostModel(block_size=block_size, **costs)
    except ConfigError as exc:
        raise ConfigError(f"preemption.cost_model: {exc}") from None
    except TypeError as exc:  # a value of the wrong kind reaches the dataclass as is
        raise ConfigError(f"preemption.cost_model: {exc}") from None
    policy = resolve_victim_policy(raw.get("victim_policy", "last_admitted"), cost_model)
    needs_costs = mode == "auto" or policy.name == "cost_aware"
    if needs_costs and not given:
        why = "mode 'auto' compares swap with recompute" if mode == "auto" else "cost_aware ranks by cost"
        raise ConfigError(
            f"preemption.cost_model.prefill_tokens_per_s is required: {why}, and recompute time is "
            "prefill time (measure it, or take it from the simulator's step model)"
        )
    return PreemptionConfig(cost_model, mode, policy)
