"""A tier kind defined in this file alone runs in the real engine and in the simulator.

Nothing in the package names the kind below: it registers itself, the engine
builds it from its configuration, and a simulator config names it by its
``type``.  That adding a kind needs no other file is what this proves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from engine_configs import engine_config
from test_engine_exact import check
from test_sim_tiers import BLOCK, CPU_ONLY, simulate, tiny
from test_tiers_engine import EVERYONE, FILLERS, FIRST, LATER, prefix_keys, serve

from tiered_kv.engine.engine import Engine
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sim.config import setup, validate_config
from tiered_kv.tiers.io_engine import BlockIOEngine, Job
from tiered_kv.tiers.io_handle import BlockOutcome
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.store import Key
from tiered_kv.tiers.tier_kind import TierConfig, find_tier_kind, known_tier_types, register_tier_kind


class DictStore(KeyedStore):
    """Blocks as byte strings in a dict, keyed by block key."""

    medium = "MEMO"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity + 1)  # slot 0 is reserved, as in every store
        self.blobs: dict[Key, bytes] = {}

    def _on_evicted(self, keys: list[Key]) -> None:
        for key in keys:
            self.blobs.pop(key, None)


class DictIO(BlockIOEngine):
    """Copies a block's bytes between the CPU tier's tensor and the dict."""

    def __init__(self, host, store: DictStore) -> None:
        super().__init__(host, store)
        self.blobs = store.blobs

    def _store_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        for job in batch:
            self.blobs[job.key] = b"".join(bytes(seg) for seg in self.host.segments(job.host_block))
        return [BlockOutcome.OK] * len(batch)

    def _load_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        out = []
        for job in batch:
            blob = self.blobs.get(job.key)
            if blob is None:
                out.append(BlockOutcome.MISSING)
                continue
            pos = 0
            for seg in self.host.segments(job.host_block):
                seg[:] = blob[pos : pos + len(seg)]
                pos += len(seg)
            out.append(BlockOutcome.OK)
        return out


@register_tier_kind
@dataclass(frozen=True, slots=True, kw_only=True)
class MemoTier(TierConfig):
    """An in-memory tier of ``capacity_blocks`` blocks."""

    type: ClassVar[str] = "memo"
    medium: ClassVar[str] = "MEMO"
    default_link: ClassVar[TierLink] = TierLink(bytes_per_s=4096.0, block_latency_s=0.5)

    capacity_blocks: int = 64

    def __post_init__(self) -> None:
        TierConfig.__post_init__(self)
        if self.capacity_blocks.__class__ is not int or self.capacity_blocks < 2:
            raise InvalidArgumentError(f"MemoTier.capacity_blocks must be an int >= 2, got {self.capacity_blocks!r}")

    def build(self, namespace, cpu_storage):
        store = DictStore(self.capacity_blocks)
        return store, DictIO(cpu_storage, store)


def test_the_new_kind_is_found_by_its_type_beside_the_packages_own():
    assert find_tier_kind("memo") is MemoTier
    assert known_tier_types() == ["disk", "memo", "redis"]
    with pytest.raises(
        InvalidArgumentError, match=r"unknown tier type 'tape'; known types: \['disk', 'memo', 'redis'\]"
    ):
        find_tier_kind("tape")
    with pytest.raises(InvalidArgumentError, match="tier type 'memo' is already MemoTier's"):

        @register_tier_kind
        @dataclass(frozen=True, slots=True, kw_only=True)
        class Other(MemoTier):
            pass

    with pytest.raises(InvalidArgumentError, match=r"MemoTier\.capacity_blocks must be an int >= 2"):
        MemoTier(capacity_blocks=1)
    assert find_tier_kind("memo") is MemoTier  # the refused registration changed nothing


def test_the_engine_loads_an_evicted_prefix_back_from_the_new_kind_with_the_same_tokens():
    config = engine_config(num_gpu_blocks=24, num_cpu_blocks=8, offload="write_through", record_logits=True)
    fast = TierLink(bytes_per_s=4e9, block_latency_s=1e-6)  # its default link is slower than recomputing here
    e = Engine(config=config, tiers=[MemoTier(write_policy="write_through", link=fast)])
    serve(e, [FIRST, *FILLERS])
    assert not any(e.scheduler.tm.store.contains(k) for k in prefix_keys())  # gone from the CPU tier
    serve(e, [LATER])
    e.close()
    m = e.metrics()
    t = m.lower_tiers["MEMO"]
    assert (
        t.loaded_blocks == t.hit_blocks >= 5
        and t.declined_blocks == 0
        and t.load_failed_blocks == 0
        and m.chain_lost_blocks == 0
    )
    assert m.counters.onboard_blocks == t.loaded_blocks
    assert e.tier_stack.engines["MEMO"].stats.blocks_loaded == t.loaded_blocks
    check(e, EVERYONE, "block_contiguous", exact_logits=False)


def test_the_simulator_runs_the_new_kind_on_its_default_link(tmp_path):
    run = {**CPU_ONLY, "name": "cpu+memo", "tiers": [{"type": "memo", "capacity_blocks": 16}]}
    cfg = validate_config(tiny(tmp_path, [run]))
    (tier,) = setup(cfg, 0).tiers.tiers
    assert (tier.name, tier.medium, tier.link.source, tier.link.read) == (
        "memo",
        "MEMO",
        "default",
        MemoTier.default_link,
    )
    res, sim = simulate(cfg, 0)
    assert set(sim.tier_engines) == {"MEMO"}
    assert res["tiers"] == f"MEMO {16 * BLOCK / 2**30:.4g} GiB (default link)"
    assert res["lower_tiers"]["memo"]["hit_blocks"] == 3
    (load,) = [j for j in sim.tier_engines["MEMO"].jobs if j.op == "load"]
    assert (load.start, len(load.handle.keys)) == (20.0, 3)
    assert load.end - load.start == pytest.approx(3 * (0.5 + BLOCK / 4096.0))


def test_a_hardware_profile_may_describe_the_new_kinds_medium(tmp_path):
    run = {**CPU_ONLY, "name": "cpu+memo", "tiers": [{"type": "memo", "capacity_blocks": 16}]}
    raw = tiny(tmp_path, [run])
    raw["hardware"]["tiers"]["memo"] = {"bandwidth_gbps": 2048e-9, "block_latency_us": 0.0}
    (tier,) = setup(validate_config(raw), 0).tiers.tiers
    assert (tier.link.source, tier.link.read) == ("profile", TierLink(2048.0, 0.0))
