"""Checks of what a driver attaches below the CPU tier: a list of :class:`~tiered_kv.tiers.lower_tier.LowerTier`.

:func:`chain_of` turns the entries into the manager's
:class:`~tiered_kv.tiers.chain.TierChain` (its CPU store first) and the maps
of I/O engines and links by medium, after checking everything, so that a
refusal changes nothing.
"""

from __future__ import annotations

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiers.chain import TierChain, TierPolicy
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.lower_tier import LowerTier
from tiered_kv.transfer.engine import CopyEngine


def chain_of(tiers: object, cpu_store: CPUStore) -> tuple[TierChain, dict[str, CopyEngine], dict[str, TierLink]]:
    """The chain ``cpu_store`` -> ``tiers``, each tier's I/O engine and link by medium.

    Tier ``i`` of the chain writes down to tier ``i + 1`` by the entry below
    it (``tiers[i].write_policy``, ``writeback_reserve``); the last tier writes nothing down.

    Raises:
        InvalidArgumentError: ``tiers`` is not a non-empty list of :class:`LowerTier`,
            a store is the CPU store or appears twice, two share a medium, or a
            write-back reserve is larger than the tier that holds it.
    """
    if tiers.__class__ not in (list, tuple):
        raise InvalidArgumentError(f"tiers must be a list of LowerTier entries, got {checks.describe(tiers)}")
    entries: list[LowerTier] = [checks.instance(f"tiers[{i}]", t, LowerTier) for i, t in enumerate(tiers)]
    if not entries:
        raise InvalidArgumentError("no tier below the CPU: there is nothing to attach")
    stores = [cpu_store, *(e.store for e in entries)]
    if len({id(s) for s in stores}) != len(stores):
        raise InvalidArgumentError("each tier below the CPU needs its own store (not the CPU store, not twice)")
    media = [s.medium for s in stores]
    if len(set(media)) != len(media):
        raise InvalidArgumentError(f"tiers must have distinct media, got {media}")
    for i, e in enumerate(entries):
        if e.write_policy == "write_back" and e.writeback_reserve > e.store.capacity:
            # Writing back more than the tier holds evicts there what was just written: it never settles.
            raise InvalidArgumentError(
                f"tiers[{i}].writeback_reserve is {e.writeback_reserve}, more than the {e.medium} tier "
                f"holds ({e.store.capacity} blocks)"
            )
    policies = [TierPolicy(e.write_policy, e.writeback_reserve) for e in entries]
    policies.append(TierPolicy("none"))
    chain = TierChain(list(zip(stores, policies, strict=True)))
    return chain, {e.medium: e.io for e in entries}, {e.medium: e.link for e in entries}
