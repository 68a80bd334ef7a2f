"""A thin adapter: our :class:`~tiered_kv.tiers.cpu_store.CPUStore` in the shape of vLLM 0.33's manager.

vLLM's own unit tests (``tests/v1/kv_offload/cpu/test_manager.py``) construct the
manager through ``CPUOffloadingManager(num_chunks, cache_policy, ...)`` and speak
vLLM's types (``ReqContext``, ``OffloadKey``, ``CPULoadStoreSpec``,
``OffloadingEvent``, the stats record).  This class translates, and nothing
else: every decision is the store's.  Our slots are vLLM's plus one (slot 0 is
reserved), so ids are shifted back here.

A vLLM ``ReqContext`` becomes one of our requests the first time the store sees
it (vLLM opens a request implicitly on first use; our store wants
``on_new_request``), and its key positions are copied over before each call.
"""

from __future__ import annotations

from typing import Any

import pytest

from tiered_kv.tiers.cpu_store import CPUStore, RequestContext


def make_adapter(v: Any) -> type:
    """The adapter class for the loaded vLLM modules ``v`` (see ``vllm_ref_offload.load``)."""
    base, common = v.base, v.common
    stats_cls = v.manager.OffloadingConnectorStats
    Metrics = common.CPUOffloadingMetrics

    class CPUStoreAsVllmManager:
        def __init__(
            self,
            num_chunks: int,
            cache_policy: str = "lru",
            cache_policy_module_path: str | None = None,
            enable_events: bool = False,
            store_threshold: int = 1,
            max_tracker_size: int = 64_000,
            info: Any = None,
        ) -> None:
            if store_threshold >= 2:
                pytest.skip("store_threshold (admission after repeated offers) is a vLLM feature we do not claim")
            self.medium = base.Medium.CPU
            self.store = CPUStore(num_chunks + 1, cache_policy, enable_events, cache_policy_module_path)
            self._contexts: dict[int, tuple[Any, RequestContext]] = {}
            self.events = [] if enable_events else None

        @property
        def _policy(self) -> Any:
            return self.store.policy

        def _ctx(self, rc: Any) -> RequestContext:
            held = self._contexts.get(id(rc))
            if held is None:
                ours = RequestContext((rc.req_id, id(rc)))
                self.store.on_new_request(ours)
                held = self._contexts[id(rc)] = (rc, ours)
            ours = held[1]
            for key, pos in rc._offload_key_positions.items():
                ours.set_position(key, pos)
            return ours

        def _open(self, rc: Any) -> RequestContext | None:
            ours = self._ctx(rc)
            return ours if ours.req_id in self.store.open_requests() else None

        def on_new_request(self, rc: Any) -> Any:
            self._ctx(rc)
            return base.RequestOffloadingContext()

        def on_request_finished(self, rc: Any) -> None:
            ours = self._open(rc)
            if ours is not None:
                self.store.on_request_finished(ours)

        def on_schedule_end(self, context: Any) -> None:
            self.store.on_schedule_end()

        def lookup(self, key: Any, rc: Any) -> Any:
            return getattr(base.LookupResult, self.store.lookup(key).name)

        def prepare_load(self, keys: Any, rc: Any) -> Any:
            spec = self.store.prepare_load(keys, self._open(rc))
            return common.CPULoadStoreSpec([i - 1 for i in spec.block_ids])

        def touch(self, keys: Any, rc: Any) -> None:
            self.store.touch(keys, self._open(rc))

        def complete_load(self, keys: Any, rc: Any) -> None:
            self.store.complete_load(keys)

        def prepare_store(self, keys: Any, rc: Any) -> Any:
            out = self.store.prepare_store(keys, self._open(rc))
            if out is None:
                return None
            spec = common.CPULoadStoreSpec([i - 1 for i in out.store_spec.block_ids])
            return base.PrepareStoreOutput(list(out.keys_to_store), spec, list(out.evicted_keys))

        def complete_store(self, keys: Any, rc: Any, success: bool = True) -> None:
            self.store.complete_store(keys, success)

        def take_events(self) -> Any:
            for e in self.store.take_events():
                yield base.OffloadingEvent(
                    keys=list(e.keys), medium=self.medium, removed=e.removed, metadata_only=e.metadata_only
                )

        def reset_cache(self) -> None:
            self.store.reset_cache()

        def get_stats(self) -> Any:
            usage = self.store.get_stats()
            stats = stats_cls()
            stats.set_gauge(Metrics.CPU_CACHE_USAGE_PERC, usage.usage)
            for size in usage.allocation_sizes:
                stats.observe_histogram(Metrics.CPU_ALLOCATION_SIZE, size)
            stats.set_gauge(Metrics.CPU_CACHE_WRITE_USAGE_PERC, usage.write_usage)
            stats.set_gauge(Metrics.CPU_CACHE_READ_USAGE_PERC, usage.read_usage)
            return stats

        def config_info(self) -> list[dict]:
            return [{}]

    return CPUStoreAsVllmManager
