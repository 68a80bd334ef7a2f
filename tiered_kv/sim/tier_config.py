"""The simulator's tiers below the CPU: how fast each medium moves blocks, and what a run puts there.

A hardware profile's optional ``tiers:`` section names each medium a run may
put below the CPU tier (``disk``, ``remote``) with the numbers of its link into
the CPU tier (the staging area of every load and store below it)::

    tiers:
      disk:   {bandwidth_gbps: 6.4, write_gbps: 3.8, block_latency_us: 40}
      remote: {bandwidth_gbps: 25.0, block_latency_us: 50}

``bandwidth_gbps`` is GB/s (1e9 bytes/s, as ``link.h2d_gbps``): the sustained
read bandwidth; ``write_gbps`` the write bandwidth (default: the read one);
``block_latency_us`` the fixed cost of one block (a file open, a server round
trip), amortised over the I/O engine's parallel requests.  Each direction is a
:class:`~tiered_kv.tiers.link.TierLink`, the manager's own model of a
link below the CPU, so the simulator's copies and the manager's load prices are
the same arithmetic.  A medium the profile leaves out gets the default link of
the tier kind a run puts there (:attr:`~tiered_kv.tiers.tier_kind.TierConfig.default_link`,
measured here).  The media a profile may name are those of the known tier kinds
(:func:`~tiered_kv.tiers.tier_kind.known_tier_types`), lowercased.

A run's ``tiers:`` list, from the CPU down, is checked and resolved into a :class:`TierSetup`::

    runs:
      - name: cpu+disk+remote
        offload: write_through              # the CPU prefix tier feeds the tiers below it
        tiers:                              # from the CPU down
          - {type: disk, capacity_gib: 512} # or capacity_blocks: N
          - type: redis
            capacity_gib: 4096
            write_policy: write_back        # when the tier above also writes its blocks here
            writeback_reserve: 64           # write_back only: blocks kept clean ahead of eviction

Each entry names a tier kind by its ``type``
(:func:`~tiered_kv.tiers.tier_kind.find_tier_kind`), the same kinds the real engine
builds; the simulator keeps the chain's bookkeeping of the kind's medium and
runs its copies on its link, from the hardware profile (above) or the kind's
default.  Its capacity comes from the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import ConfigError, InvalidArgumentError
from tiered_kv.sim.schema import Field, choice, integer, non_negative, num, positive, validate
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.tier_kind import TierConfig, find_tier_kind, known_tier_types
from tiered_kv.tiers.write_policy import RENAMED

GB = 1e9

MEDIUM_SCHEMA = {
    "bandwidth_gbps": num(None, positive, nullable=True),
    "write_gbps": num(None, positive, nullable=True),
    "block_latency_us": num(None, non_negative, nullable=True),
}
TIERS_SCHEMA = Field((dict,), None, nullable=True)
"""The ``tiers:`` section of a hardware profile (see :data:`tiered_kv.sim.profiles.HARDWARE_SCHEMA`):
medium name -> :data:`MEDIUM_SCHEMA`, checked by :func:`tier_media`."""


def profile_name(kind: type[TierConfig]) -> str:
    """The name of a tier kind's medium in a hardware profile (``DISK`` -> ``disk``)."""
    return kind.medium.lower()


@dataclass(frozen=True, slots=True)
class TierMedium:
    """One medium below the CPU tier: its link for loads (into the CPU tier) and for stores (out of it).

    Attributes:
        read: Loads, medium -> CPU tier; also what the manager prices a load with.
        write: Stores, CPU tier -> medium.
        source: ``"profile"`` (the hardware profile gives it) or ``"default"`` (the manager's default).
    """

    read: TierLink
    write: TierLink
    source: str = "profile"


def _medium(name: str, d: Mapping[str, Any], key: str) -> TierMedium | None:
    given = {k: v for k, v in d.items() if v is not None}
    if not given:
        return None
    for need in ("bandwidth_gbps", "block_latency_us"):
        if need not in given:
            raise ConfigError(f"{key}.{name}.{need}: required when the {name} tier is described")
    latency = given["block_latency_us"] * 1e-6
    read = TierLink(given["bandwidth_gbps"] * GB, latency)
    write = TierLink(given.get("write_gbps", given["bandwidth_gbps"]) * GB, latency)
    return TierMedium(read, write)


def tier_media(section: Mapping[str, Any] | None, key: str = "hardware.tiers") -> Mapping[str, TierMedium]:
    """Medium name -> :class:`TierMedium` from a ``tiers:`` section (only the media it describes).

    Raises:
        ConfigError: a name is no known kind's medium, a key is unknown, or a described
            medium lacks its bandwidth or its latency (the message names the key).
    """
    names = {profile_name(find_tier_kind(t)) for t in known_tier_types()}
    out: dict[str, TierMedium] = {}
    for name, d in (section or {}).items():
        if name not in names:
            raise ConfigError(f"{key}.{name}: unknown key (known keys here: {', '.join(sorted(names))})")
        medium = _medium(name, validate(d, MEDIUM_SCHEMA, f"{key}.{name}"), key)
        if medium is not None:
            out[name] = medium
    return out  # a plain dict: a profile travels to worker processes, and a mapping proxy does not pickle


def medium_for(kind: type[TierConfig], media: Mapping[str, TierMedium]) -> TierMedium:
    """The profile's :class:`TierMedium` for a kind's medium, or the kind's default link both ways."""
    medium = media.get(profile_name(kind))
    if medium is None:
        medium = TierMedium(kind.default_link, kind.default_link, "default")
    return medium


GIB = 1 << 30
ENTRY_SCHEMA: dict[str, Any] = {
    "type": Field((str,)),
    "capacity_gib": num(None, positive, nullable=True),
    "capacity_blocks": Field((int,), None, None, (positive,), nullable=True),
    # write_through: a block goes down as soon as it is stored above (nothing is lost to eviction);
    # write_back: only the writeback_reserve least recent blocks of the tier above are kept held here.
    "write_policy": choice("write_through", "write_through", "write_back"),
    "writeback_reserve": integer(64, non_negative),
}
"""One entry of a run's ``tiers:`` list."""

RUN_TIERS_SCHEMA = Field((list, dict), [])  # a mapping is the old layout: resolve_tiers says what it is now
"""The ``tiers:`` key of a run (see :data:`tiered_kv.sim.config_schema.RUN_SCHEMA`): a list of :data:`ENTRY_SCHEMA`."""


@dataclass(frozen=True, slots=True)
class SimTier:
    """One tier below the CPU in a simulated run.

    Attributes:
        name: Its medium's name in the hardware profile (``disk``, ``remote``);
            ``medium`` its store medium (``DISK``, ``REMOTE``).
        num_blocks: Blocks it holds.
        capacity_gib: Its KV capacity.
        link: Its read and write links (from the hardware profile, or the kind's default).
        write_policy / writeback_reserve: How the tier above writes its blocks here.
    """

    name: str
    medium: str
    num_blocks: int
    capacity_gib: float
    link: TierMedium
    write_policy: str = "write_through"
    writeback_reserve: int = 64


@dataclass(frozen=True, slots=True)
class TierSetup:
    """The tiers below the CPU of one run, highest first."""

    tiers: tuple[SimTier, ...]

    @property
    def links(self) -> dict[str, TierLink]:
        """Medium -> the link the manager prices loads from it with (its read link)."""
        return {t.medium: t.link.read for t in self.tiers}

    def describe(self) -> str:
        """``DISK 512 GiB + REMOTE 4096 GiB (default link)`` (``""`` without tiers).

        ``(default link)`` marks a medium the hardware profile does not describe.
        """
        return " + ".join(
            f"{t.medium} {t.capacity_gib:.4g} GiB" + (" (default link)" if t.link.source == "default" else "")
            for t in self.tiers
        )


NO_TIERS = TierSetup(())


def _entries(section: object, key: str) -> Sequence[Any]:
    if isinstance(section, Mapping):  # the layout before tiers were a list of kinds
        example = ", ".join(f"{{type: {'redis' if n == 'remote' else n}, ...}}" for n in section if n != "demote")
        raise ConfigError(
            f"{key}: tiers are now a list of entries from the CPU down, each with its type, e.g. [{example}]; "
            "the section's demote: is each entry's write_policy:"
        )
    return section  # type: ignore[return-value]


def resolve_tiers(
    section: object,
    media: Mapping[str, TierMedium],
    block_bytes: int,
    num_cpu_blocks: int,
    offload: str,
    key: str,
) -> TierSetup:
    """The run's ``tiers:`` list as a :class:`TierSetup`.

    Raises:
        ConfigError: an entry is not a mapping of :data:`ENTRY_SCHEMA`, names an unknown
            type or a medium twice, gives both or neither capacity, holds fewer than 2
            blocks, or a write-back reserve exceeds its tier; or the run has no CPU
            prefix tier to feed the tiers (no CPU blocks, or ``offload: none``); the
            message names the key.
    """
    tiers: list[SimTier] = []
    for i, raw in enumerate(_entries(section, key)):
        where = f"{key}[{i}]"
        if isinstance(raw, Mapping) and raw.get("demote") is not None and "write_policy" not in raw:
            raise ConfigError(f"{where}.demote: is now write_policy: (when the tier above writes its blocks here)")
        if isinstance(raw, Mapping) and raw.get("write_policy") in RENAMED:
            old = raw["write_policy"]
            raise ConfigError(f"{where}.write_policy: {old!r} is now {RENAMED[old]!r}")
        entry = validate(raw, ENTRY_SCHEMA, where)
        try:
            kind = find_tier_kind(entry["type"])
        except InvalidArgumentError as exc:
            raise ConfigError(f"{where}.type: {exc}") from None
        name = profile_name(kind)
        if any(t.medium == kind.medium for t in tiers):
            raise ConfigError(f"{where}.type: a run has one tier per medium, and {kind.medium} is there already")
        gib, blocks = entry["capacity_gib"], entry["capacity_blocks"]
        if (gib is None) == (blocks is None):
            raise ConfigError(f"{where}: give capacity_gib or capacity_blocks (one of them)")
        if blocks is None:
            blocks = int(gib * GIB // block_bytes)
            if blocks < 2:
                raise ConfigError(f"{where}.capacity_gib: {gib} GiB holds fewer than 2 blocks of {block_bytes} B")
        elif blocks < 2:
            raise ConfigError(f"{where}.capacity_blocks: must be >= 2, got {blocks}")
        reserve = entry["writeback_reserve"]
        if entry["write_policy"] == "write_back" and reserve > blocks:
            raise ConfigError(
                f"{where}.writeback_reserve: {reserve} blocks is more than the {name} tier holds ({blocks} blocks)"
            )
        link = medium_for(kind, media)
        tiers.append(
            SimTier(name, kind.medium, blocks, blocks * block_bytes / GIB, link, entry["write_policy"], reserve)
        )
    if not tiers:
        return NO_TIERS
    if num_cpu_blocks == 0:
        raise ConfigError(f"{key}: tiers below the CPU stage through a CPU tier, but the run has no CPU blocks")
    if offload == "none":
        raise ConfigError(
            f"{key}: tiers below the CPU are fed by the CPU prefix tier: the run needs offload: write_through "
            "or write_back"
        )
    return TierSetup(tuple(tiers))
