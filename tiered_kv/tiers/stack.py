"""The tiers below one manager's CPU tier, built from their configurations and closed in order.

A driver (the engine, a user's own loop) builds a :class:`TierStack` from the
manager's CPU store, the CPU tier's tensor and a list of tier configurations
(:class:`~tiered_kv.tiers.tier_kind.TierConfig`, from the CPU down), then hands
its :attr:`~TierStack.entries` to
:meth:`TierManager.attach_tiers <tiered_kv.manager.TierManager.attach_tiers>`.
The stack owns what it built: :meth:`TierStack.close` stops the I/O engines
first (they finish what is queued) and then releases the stores.  It knows no
kind of tier by name: each configuration builds its own store and engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.lower_tier import LowerTier
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.tier_kind import TierConfig


def check_tier_configs(tiers: object) -> list[TierConfig]:
    """``tiers`` as a list of tier configurations with distinct media.

    Raises:
        InvalidArgumentError: not a list or tuple of :class:`TierConfig`, or two share a medium.
    """
    if tiers.__class__ not in (list, tuple):
        raise InvalidArgumentError(f"tiers must be a list of tier configurations, got {checks.describe(tiers)}")
    out = [checks.instance(f"tiers[{i}]", t, TierConfig) for i, t in enumerate(tiers)]
    media = [t.medium for t in out]
    if len(set(media)) != len(media) or "CPU" in media:
        raise InvalidArgumentError(f"tiers must have distinct media below the CPU, got {media}")
    return out


class TierStack:
    """The stores and I/O engines of the tiers below the CPU, as :class:`LowerTier` entries, highest first.

    Args:
        cpu_store: The manager's CPU store (the tier above the first entry).
        cpu_storage: The CPU tier's tensor (the staging area of every I/O engine).
        namespace: What the stored KV is compatible with (model, KV shape, hash scheme).
        tiers: The tier configurations, from the CPU down (at least one).

    A configuration's ``writeback_reserve`` is capped at what its tier holds: a
    larger reserve would evict there what it just wrote.

    Raises:
        InvalidArgumentError: a bad argument, or no tier.
        StorageError: a disk directory cannot be used (unwritable, or in use).
        MissingDependencyError: a remote tier without the ``redis`` package.
        Whatever fails, nothing stays open.
    """

    def __init__(
        self, cpu_store: CPUStore, cpu_storage: KVStorage, namespace: KVNamespace, tiers: Sequence[TierConfig]
    ) -> None:
        checks.instance("cpu_store", cpu_store, CPUStore)
        checks.instance("cpu_storage", cpu_storage, KVStorage)
        checks.instance("namespace", namespace, KVNamespace)
        configs = check_tier_configs(tiers)
        if not configs:
            raise InvalidArgumentError("a tier stack needs at least one tier below the CPU")
        if cpu_storage.num_blocks != cpu_store.num_blocks or cpu_storage.spec != namespace.spec:
            raise InvalidArgumentError(
                f"the CPU tier's tensor ({cpu_storage.num_blocks} blocks of {cpu_storage.spec}) does not match its "
                f"store ({cpu_store.num_blocks} blocks) and the namespace's KV spec ({namespace.spec})"
            )
        self._built: list[tuple[CPUStore, Any]] = []
        built: dict[int, tuple[CPUStore, Any]] = {}
        try:
            # Lowest first: a remote tier checks its arguments and connects lazily, so a refusal
            # there comes before a tier above it has made any file.
            for i in reversed(range(len(configs))):
                built[i] = configs[i].build(namespace, cpu_storage)
                self._built.append(built[i])
        except BaseException:
            self.close()
            raise
        self.entries: tuple[LowerTier, ...] = tuple(
            LowerTier(store, io, c.effective_link, c.write_policy, min(c.writeback_reserve, store.capacity))
            for c, (store, io) in ((c, built[i]) for i, c in enumerate(configs))
        )

    @property
    def stores(self) -> dict[str, CPUStore]:
        """Medium -> the store of that tier."""
        return {e.medium: e.store for e in self.entries}

    @property
    def engines(self) -> dict[str, Any]:
        """Medium -> the I/O engine of that tier."""
        return {e.medium: e.io for e in self.entries}

    def close(self) -> None:
        """Stop the I/O engines (queued plans finish first), then release the stores that hold a resource."""
        for _, io in reversed(self._built):
            io.close()
        for store, _ in reversed(self._built):
            close = getattr(store, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> TierStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
