"""tiered_kv's CPU store as vLLM 0.33's scheduler-side ``OffloadingManager``, with optional load pricing.

:class:`~tiered_kv.tiers.cpu_store.CPUStore` already has vLLM 0.33's manager
protocol and semantics (``tests/test_store_vllm_parity.py`` replays the same
call sequences into both and compares every answer).  This class translates
vLLM's types to the store's and back, and decides nothing itself, except for
one thing vLLM's managers do not do: **load pricing**.

With pricing on, ``lookup`` prices the run of chunks the store holds from the
asked key on against recomputing them (:func:`tiered_kv.manager.pricing.price_load`,
the same quote tiered_kv's own admission uses) and answers ``MISS`` where
recomputing that run is no slower than loading it, so vLLM's connector stops
the hit run there and prefills the rest.  vLLM's connector looks a request's
keys up in order and stops at the first non-hit; because loads add up block by
block and the quote's prefill depends only on where recomputation starts, the
chunk at which the per-key answers turn to ``MISS`` is the cut the whole-run
quote would choose (up to the one fixed per-copy cost, which the per-key quote
charges again at each key and so cuts no later than the whole-run quote).

Slots: vLLM's chunk ids start at 0, the store's slots at 1 (slot 0 is
reserved), so ids are shifted by one at the boundary.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiered_kv.integrations.vllm import _vllm  # noqa: F401  (a clear error where vLLM is missing)
from tiered_kv.manager.pricing import CostModel, LoadQuote, price_load
from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.store import LookupResult as StoreLookup

_LOOKUP = {StoreLookup.HIT: LookupResult.HIT, StoreLookup.HIT_PENDING: LookupResult.HIT_PENDING}


def key_positions(rc: ReqContext) -> dict[OffloadKey, int]:
    """The end-token position of each of the request's keys, as vLLM's scheduler recorded them.

    vLLM 0.33's ``ReqContext`` records them for managers ("so managers can recover prefix
    order") but offers a getter per key only; the store needs them all, so this one function
    reads the record, and only reads it.
    """
    return dict(rc._offload_key_positions)


class LoadPricing:
    """Prices a hit run on the CPU tier against its recomputation (the ``load_pricing`` option).

    Args:
        cost_model: CPU-to-GPU copy and prefill estimates; ``block_size`` is the tokens of one chunk.
        link: How fast a chunk reaches the CPU tier before its GPU copy (``None``: it is already
            there, the CPU store's case); a :class:`TierLink` per medium, as tiered_kv's own tiers use.

    Attributes:
        priced: Hit lookups priced.
        declined: Of those, the ones answered ``MISS`` (each ends a request's hit run there).
        last_quote: The latest quote (its ``reason`` says the decision in words).
    """

    def __init__(self, cost_model: CostModel, link: TierLink | None = None) -> None:
        self.cost_model = cost_model
        self.link = link
        self.priced = 0
        self.declined = 0
        self.last_quote: LoadQuote | None = None

    def worth_loading(self, store: CPUStore, key: OffloadKey, req_context: ReqContext) -> bool:
        """Whether loading ``key``'s chunk (and the run after it) beats recomputing from there.

        The run is the request's keys from ``key`` on, in position order, that the store
        holds ready; the request's length is its last key's end (the scheduler records the
        end-token position of every key of the request).  A key without a position is loaded.
        """
        positions = key_positions(req_context)
        start = req_context.get_offload_key_position(key)
        if start is None or not positions:
            return True
        later = sorted((pos, k) for k, pos in positions.items() if pos >= start)
        run = []
        for _, k in later:
            if not store.is_ready(k):
                break
            run.append(k)
        if not run:
            return True
        bs = self.cost_model.block_size
        num_tokens = max(positions.values()) + 1  # the last token is always computed
        quote = price_load(
            self.cost_model,
            req_context.req_id,
            ["CPU" if self.link is None else "LINK"] * len(run),
            [self.link] * len(run),
            max(0, start - bs),
            num_tokens,
        )
        self.priced += 1
        self.last_quote = quote
        if quote.num_blocks == 0:
            self.declined += 1
            return False
        return True


class TieredKVOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over a :class:`CPUStore` of ``num_chunks`` chunks.

    Args:
        num_chunks: Chunks of vLLM's CPU region (the store has one more slot, the reserved 0).
        cache_policy: The store's policy (``"lru"``, ``"arc"`` or one loaded from a module path).
        cache_policy_module_path: Where an out-of-tree policy is (vLLM's key of the same name).
        enable_events: Queue store/remove events for vLLM's KV events.
        pricing: Load pricing, or ``None`` for vLLM's plain answers.
        info: vLLM's ``CPUOffloadingInfo`` (its info metric), if any.

    Invariant: every answer is the store's, except a ``HIT`` that pricing turns to ``MISS``.
    """

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        pricing: LoadPricing | None = None,
        info: Any = None,
    ) -> None:
        self.medium = Medium.CPU
        self.store = CPUStore(num_chunks + 1, cache_policy, enable_events, cache_policy_module_path)
        self.pricing = pricing
        self._info = info
        self._contexts: dict[int, tuple[ReqContext, RequestContext]] = {}
        self._hidden: set[OffloadKey] = set()

    @property
    def lock(self) -> AbstractContextManager[Any]:
        # Entered only from the scheduler's thread: no background thread touches the store.
        return nullcontext()

    # ------------------------------------------------------------ requests
    def _ctx(self, rc: ReqContext) -> RequestContext:
        held = self._contexts.get(id(rc))
        if held is None or held[0] is not rc:
            ours = RequestContext((rc.req_id, id(rc)))
            self.store.on_new_request(ours)
            held = self._contexts[id(rc)] = (rc, ours)
        ours = held[1]
        for key, pos in key_positions(rc).items():
            if ours.position(key) is None:
                ours.set_position(key, pos)
        return ours

    def _open(self, rc: ReqContext) -> RequestContext | None:
        ours = self._ctx(rc)
        return ours if ours.req_id in self.store.open_requests() else None

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._ctx(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        ours = self._open(req_context)
        if ours is not None:
            self.store.on_request_finished(ours)
        self._contexts.pop(id(req_context), None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.store.on_schedule_end()

    # ------------------------------------------------------------ stores at preemption
    def hide(self, keys: Iterable[OffloadKey]) -> None:
        """Answer ``MISS`` for ``keys`` until :meth:`unhide`: a store at preemption is writing them.

        vLLM's connector defers a request whose hit is still being stored (``HIT_PENDING``)
        until the store is reported; a victim scheduled again while its own store at
        preemption is in flight (or after it failed) recomputes from the first such key
        instead, and nothing waits on a store that may never land.
        """
        self._hidden.update(keys)

    def unhide(self, keys: Iterable[OffloadKey]) -> None:
        self._hidden.difference_update(keys)

    def hidden(self) -> frozenset[OffloadKey]:
        """Keys that answer ``MISS`` while their store at preemption is in flight."""
        return frozenset(self._hidden)

    # ------------------------------------------------------------ the protocol
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._hidden and key in self._hidden:
            self.store.lookup(key)  # counted, as every lookup is
            return LookupResult.MISS
        found = _LOOKUP.get(self.store.lookup(key), LookupResult.MISS)
        if found is LookupResult.HIT and self.pricing is not None:
            if not self.pricing.worth_loading(self.store, key, req_context):
                return LookupResult.MISS
        return found

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        spec = self.store.prepare_load(list(keys), self._open(req_context))
        return CPULoadStoreSpec([i - 1 for i in spec.block_ids])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch(list(keys), self._open(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.complete_load(list(keys))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        out = self.store.prepare_store(list(keys), self._open(req_context))
        if out is None:
            return None
        spec = CPULoadStoreSpec([i - 1 for i in out.store_spec.block_ids])
        return PrepareStoreOutput(list(out.keys_to_store), spec, list(out.evicted_keys))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.store.complete_store(list(keys), success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        for e in self.store.take_events():
            yield OffloadingEvent(
                keys=list(e.keys), medium=self.medium, removed=e.removed, metadata_only=e.metadata_only
            )

    def reset_cache(self) -> None:
        """Forget every chunk, as vLLM's CPU manager does, even with copies in flight.

        vLLM's connector resets its manager with jobs in flight: it marks them stale
        (their reports are ignored, never completed here) and flushes them to the
        workers before any new store is submitted.  So the store's in-flight stores
        are dropped and its load pins released before the store is cleared (it
        refuses to clear over copies it still counts).
        """
        entries = self.store.entries()
        pending = [e.key for e in entries if not e.ready]
        if pending:
            self.store.complete_store(pending, False)
        for e in entries:
            for _ in range(e.ref_cnt if e.ready else 0):
                self.store.complete_load([e.key])
        self._hidden.clear()
        self.store.reset_cache()

    def get_stats(self) -> OffloadingConnectorStats | None:
        usage = self.store.get_stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage.usage)
        for size in usage.allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, usage.write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, usage.read_usage)
        return stats

    def config_info(self) -> Sequence[Any]:
        return [self._info.as_config_info()] if self._info is not None else [{}]
