"""The link of a tier below the CPU: how fast its blocks come into the CPU tier.

It lives with the tiers because each tier kind names its own default link
(:attr:`~tiered_kv.tiers.tier_kind.TierConfig.default_link`); the manager
prices loads with it (:func:`~tiered_kv.manager.pricing.price_load`) and the
simulator runs its copies on it, so both use the same arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiered_kv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TierLink:
    """How fast blocks come from one tier below the CPU into the CPU tier (the staging area).

    Loading ``n`` blocks of ``b`` bytes costs ``n * (block_latency_s + b / bytes_per_s)``:
    a block is one file or one value, so each pays its own fixed cost (a file
    open and read, a server round trip shared by a pipeline) before its bytes.

    Attributes:
        bytes_per_s: Sustained read bandwidth of the medium, as the tier's I/O engine sees it.
        block_latency_s: Fixed cost of each block, amortised over the engine's parallel requests.
    """

    bytes_per_s: float
    block_latency_s: float

    def __post_init__(self) -> None:
        for name in ("bytes_per_s", "block_latency_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or math.isnan(v) or v < 0 or v == math.inf:
                raise ConfigError(f"tier link: {name} must be a finite number >= 0, got {v!r}")
        if self.bytes_per_s == 0:
            raise ConfigError("tier link: bytes_per_s must be > 0")

    def load_time(self, num_blocks: int, bytes_per_block: int) -> float:
        """Seconds to bring ``num_blocks`` blocks into the CPU tier."""
        return num_blocks * (self.block_latency_s + bytes_per_block / self.bytes_per_s) if num_blocks > 0 else 0.0
