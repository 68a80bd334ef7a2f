"""Checks of what a driver attaches below the CPU tier: a chain of stores, their I/O engines, their links.

The chain (:class:`tiered_kv.tiers.chain.TierChain`) and its stores live in the
tier layer, beside the manager; :func:`check_tiers` checks whatever a driver
hands over before anything is attached.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.cost_model import DEFAULT_TIER_LINKS, TierLink
from tiered_kv.tiers.chain import DEMOTE_MODES, TierChain
from tiered_kv.tiers.store import BlockStore
from tiered_kv.transfer.engine import CopyEngine

CHAIN_METHODS = (
    "lookup",
    "stage",
    "demote",
    "finish",
    "finish_handle",
    "after_store",
    "writeback_due",
    "only_copies",
    "check_invariants",
)


def check_tiers(
    chain: object,
    cpu_store: BlockStore,
    engines: object,
    links: object,
) -> tuple[TierChain, dict[str, CopyEngine], dict[str, TierLink]]:
    """Check a chain, its I/O engines and links against the manager; return them with every link filled in.

    Raises:
        InvalidArgumentError: the chain lacks a verb, its first tier is not
            ``cpu_store``, it has no tier below the CPU, a tier's policy is
            unknown, an engine is missing or is not one, or a link is missing
            (for a medium without a default) or is not a :class:`TierLink`.
    """
    missing = [m for m in CHAIN_METHODS if not callable(getattr(chain, m, None))]
    stores, policies = getattr(chain, "stores", None), getattr(chain, "policies", None)
    if missing or stores.__class__ is not tuple or policies.__class__ is not tuple:
        raise InvalidArgumentError(
            f"chain must be a tier chain (stores, policies, {', '.join(CHAIN_METHODS)}), got {checks.describe(chain)}"
        )
    if not stores or stores[0] is not cpu_store:
        first = checks.describe(stores[0]) if stores else "nothing"
        raise InvalidArgumentError(f"the chain's first tier must be this manager's CPU store, got {first}")
    if len(stores) < 2:
        raise InvalidArgumentError("the chain has no tier below the CPU: there is nothing to attach")
    if len(policies) != len(stores):
        raise InvalidArgumentError(f"the chain has {len(stores)} stores but {len(policies)} policies")
    for i, (store, policy) in enumerate(zip(stores, policies, strict=True)):
        checks.instance(f"chain.stores[{i}]", store, BlockStore)
        demote = checks.choice(f"chain.policies[{i}].demote", getattr(policy, "demote", None), DEMOTE_MODES)
        reserve = checks.count(f"chain.policies[{i}].writeback_reserve", getattr(policy, "writeback_reserve", None))
        if demote == "write_back" and i + 1 < len(stores) and reserve > stores[i + 1].capacity:
            # Writing back more than the tier below holds evicts there what was just written: it never settles.
            raise InvalidArgumentError(
                f"chain.policies[{i}].writeback_reserve is {reserve}, more than the {stores[i + 1].medium} tier "
                f"below holds ({stores[i + 1].capacity} blocks)"
            )
    lower = [s.medium for s in stores[1:]]
    return chain, _engines(engines, lower), check_links(links, lower)  # type: ignore[return-value]


def _engines(engines: object, media: list[str]) -> dict[str, CopyEngine]:
    if not isinstance(engines, Mapping) or set(engines) != set(media):
        got = list(engines) if isinstance(engines, Mapping) else checks.describe(engines)
        raise InvalidArgumentError(f"engines must map each medium below the CPU ({media}) to its I/O engine, got {got}")
    for medium, engine in engines.items():
        if not all(callable(getattr(engine, n, None)) for n in ("submit", "cancel")):
            raise InvalidArgumentError(
                f"engines[{medium!r}] must have submit() and cancel(), got {checks.describe(engine)}"
            )
    return dict(engines)


def check_links(links: object, media: list[str]) -> dict[str, TierLink]:
    """``links`` (medium -> :class:`TierLink`, or ``None``) checked against ``media``, with defaults filled in.

    Raises:
        InvalidArgumentError: a link is not a :class:`TierLink`, names a medium not in
            ``media``, or a medium has no link and no default.
    """
    if links is None:
        links = {}
    if not isinstance(links, Mapping):
        raise InvalidArgumentError(f"links must map media to TierLinks, got {checks.describe(links)}")
    unknown = sorted(set(links) - set(media))
    if unknown:
        raise InvalidArgumentError(f"links names media {unknown} that are not below the CPU in the chain ({media})")
    out = {}
    for medium in media:
        link = links.get(medium, DEFAULT_TIER_LINKS.get(medium))
        if link is None:
            raise InvalidArgumentError(f"no TierLink for medium {medium!r} and no default: give links={{...}}")
        out[medium] = checks.instance(f"links[{medium!r}]", link, TierLink)
    return out
