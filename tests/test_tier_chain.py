"""The chain CPU -> disk -> remote: per-block lookups, two-sided moves, demotion policies, bytes end to end."""

from __future__ import annotations

import pytest
import torch
from tierutil import NS, block_bytes, host, key

from tiered_kv.errors import BlockStateError, InvalidArgumentError
from tiered_kv.tiers.chain import ChainLookup, TierChain, TierPolicy
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_handle import BlockOutcome
from tiered_kv.tiers.redis_io import RedisIO
from tiered_kv.tiers.redis_store import RedisStore
from tiered_kv.transfer.controlled import ControlledCopyEngine
from tiered_kv.transfer.plan import PlanKind

fakeredis = pytest.importorskip("fakeredis")  # in the test extra; absent on bare GPU machines

SLOT = 4096
WB, WT, NONE = TierPolicy("write_back", writeback_reserve=2), TierPolicy("write_through"), TierPolicy("none")


class Tiers:
    """A CPU tier (tensor + store), a disk tier and a remote tier on a fake server, chained."""

    def __init__(self, tmp_path, cpu_blocks=5, disk_blocks=4, policies=(WB, WB, NONE), server=None):
        self.server = server or fakeredis.FakeServer()
        self.st = host(num_blocks=cpu_blocks + 1, seed=1)
        self.cpu = CPUStore(cpu_blocks + 1)
        self.disk = DiskStore(tmp_path, NS, disk_blocks * SLOT)
        self.remote = RedisStore(fakeredis.FakeRedis(server=self.server), NS, index_blocks=64)
        self.chain = TierChain(list(zip((self.cpu, self.disk, self.remote), policies, strict=True)))
        self.io = {1: DiskIO(self.st, self.disk), 2: RedisIO(self.st, self.remote)}
        self.plans = 0
        self.truth: dict = {}  # key -> the bytes it was computed with

    def compute(self, keys, seed=0) -> None:
        """Blocks computed on the GPU and offloaded to the CPU tier (random KV per key)."""
        out = self.cpu.prepare_store(list(keys))
        assert out is not None
        gen = torch.Generator().manual_seed(seed)
        for k, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self.st.kv[slot].copy_(torch.randn(self.st.kv[slot].shape, generator=gen).to(self.st.kv.dtype))
            self.truth[k] = block_bytes(self.st, slot)
        self.cpu.complete_store(out.keys_to_store)

    def run(self, move):
        """Execute a move with the engine of the tier below the CPU that it touches; finish it."""
        self.plans += 1
        engine = self.io[max(move.src, move.dst)]
        handle = engine.submit(move.plan(self.plans, PlanKind.OFFLOAD))
        assert handle.wait(10) or handle.done()
        return self.chain.finish_handle(move, handle)

    def cpu_bytes(self, k) -> bytes:
        return block_bytes(self.st, self.cpu.prepare_load([k]).block_ids[0])

    def close(self) -> None:
        for io in self.io.values():
            io.close()
        self.disk.close()


@pytest.fixture
def tiers(tmp_path):
    t = Tiers(tmp_path)
    yield t
    t.close()


def test_lookup_names_the_highest_tier_of_each_block_and_asks_each_tier_only_about_the_rest(tiers):
    t = tiers
    t.compute([key(i) for i in range(4)])
    assert t.run(t.chain.demote(0, [key(0), key(1)])) == [key(0), key(1)]  # now on disk too
    assert t.run(t.chain.demote(0, [key(1)], dst=2)) == [key(1)]  # and on the remote
    t.cpu.remove([key(1)])  # key 1: disk and remote; key 0: CPU and disk
    t.compute([key(6)])
    assert t.run(t.chain.demote(0, [key(6)])) == [key(6)]
    t.cpu.remove([key(6)])
    # Disk to remote goes through the CPU tier: stage, then demote from the CPU.
    assert t.run(t.chain.stage([key(6)], 1)) == [key(6)]
    assert t.run(t.chain.demote(0, [key(6)], dst=2)) == [key(6)]
    t.cpu.remove([key(6)])
    t.disk.remove([key(6)])  # key 6: remote only
    queries = t.remote.stats.queries
    found = t.chain.lookup([key(0), key(1), key(6), key(2), key(4), key(3)])
    assert found == ChainLookup((0, 1, 2, 0)) and found.length == 4 and found.count(0) == 2
    assert t.remote.stats.queries - queries == 2  # only key 6 and key 4 were asked of the server
    assert t.chain.lookup([key(4), key(0)]) == ChainLookup(())
    assert [t.chain.route(i) for i in range(3)] == [("CPU", "GPU"), ("DISK", "CPU", "GPU"), ("REMOTE", "CPU", "GPU")]
    t.chain.check_invariants()


def test_a_prefix_evicted_from_cpu_and_disk_comes_back_from_the_remote_byte_for_byte(tiers):
    t = tiers
    prefix = [key(i) for i in range(4)]
    t.compute(prefix, seed=3)
    assert t.chain.writeback_due(0) == prefix[:2]  # the two least recent blocks not held below
    assert t.run(t.chain.demote(0, prefix)) == prefix
    assert t.run(t.chain.demote(0, prefix, dst=2)) == prefix
    # Other work pushes the prefix out of the CPU tier, then out of the disk tier.
    t.compute([key(10 + i) for i in range(5)], seed=4)
    assert not any(t.cpu.contains(k) for k in prefix)
    assert t.chain.only_copies(0, prefix) == []  # evicted from the CPU, but the chain still has them
    t.run(t.chain.demote(0, [key(10 + i) for i in range(4)]))
    assert not any(t.disk.contains(k) for k in prefix)
    found = t.chain.lookup(prefix)
    assert found.tiers == (2, 2, 2, 2)
    move = t.chain.stage(prefix, 2)
    assert move.src == 2 and move.dst == 0 and len(move.evicted) == 4
    assert t.run(move) == prefix
    assert [t.cpu_bytes(k) for k in prefix] == [t.truth[k] for k in prefix]
    assert t.chain.lookup(prefix).tiers == (0, 0, 0, 0)
    t.chain.check_invariants()


def test_no_block_is_evicted_while_a_move_touches_it(tiers):
    t = tiers
    t.compute([key(i) for i in range(5)])  # the CPU tier is full
    move = t.chain.demote(0, [key(0), key(1), key(2), key(3)])
    assert (t.cpu.num_pinned, t.cpu.num_evictable, t.disk.num_pending) == (4, 1, 4)
    t.chain.check_invariants()
    before = (t.cpu.entries(), t.disk.entries())
    assert t.cpu.prepare_store([key(8), key(9)]) is None  # only key 4 could go: the move pins the rest
    assert t.disk.prepare_store([key(9)]) is None  # every disk slot is pending
    with pytest.raises(BlockStateError, match="load"):
        t.cpu.remove([key(0)])
    assert (t.cpu.entries(), t.disk.entries()) == before
    assert t.run(move) == [key(0), key(1), key(2), key(3)]
    assert t.cpu.num_pinned == 0 and t.disk.num_pending == 0
    t.chain.check_invariants()


def test_a_failed_move_rolls_back_only_what_did_not_land(tmp_path):
    t = Tiers(tmp_path)
    try:
        t.compute([key(i) for i in range(3)])

        def full_disk(op, k):
            if k == key(1):
                raise OSError(28, "No space left on device")

        t.io[1] = DiskIO(t.st, t.disk, fault_hook=full_disk)
        move = t.chain.demote(0, [key(0), key(1), key(2)])
        assert t.run(move) == [key(0), key(2)]
        assert [e.key for e in t.disk.entries()] == [key(0), key(2)] and t.cpu.num_pinned == 0
        assert t.chain.only_copies(0, [key(1)]) == [key(1)]  # still only in the CPU tier: not lost
        assert t.cpu_bytes(key(1)) == t.truth[key(1)]
        t.disk.path_of(key(2)).write_bytes(b"garbage")
        move = t.chain.stage([key(0), key(2)], 1)  # key 0, key 2 are in the CPU already: nothing to copy
        assert move.keys == () and t.run(move) == []
        t.cpu.remove([key(2)])
        move = t.chain.stage([key(0), key(2)], 1)
        assert move.keys == (key(2),)
        assert t.run(move) == [] and not t.disk.contains(key(2)) and not t.cpu.contains(key(2))  # corrupt: forgotten
        assert t.io[1].stats.outcomes[BlockOutcome.CORRUPT.value] == 1
        t.chain.check_invariants()
    finally:
        t.close()


def test_write_through_demotes_on_store_and_write_back_keeps_a_clean_reserve(tmp_path):
    t = Tiers(tmp_path, policies=(WT, WB, NONE))
    try:
        t.compute([key(0), key(1), ("req-1", 0)])
        assert t.chain.after_store(0, [key(0), key(1), ("req-1", 0), key(7)]) == [key(0), key(1)]  # not private
        assert t.chain.writeback_due(0) == []  # write-through: nothing waits for eviction
        t.run(t.chain.demote(0, [key(0), key(1)]))
        assert t.chain.after_store(0, [key(0), key(1)]) == []  # held below already
        assert t.chain.writeback_due(1) == [key(0), key(1)]  # disk is write-back with a reserve of 2
        t.run(t.chain.demote(0, [key(0)], dst=2))  # key 0 is still in the CPU tier: no staging needed
        assert t.chain.writeback_due(1) == [key(1)]
        assert t.chain.writeback_due(2) == [] and t.chain.after_store(2, [key(0)]) == []  # the last tier
    finally:
        t.close()


def test_bad_requests_are_refused_and_change_nothing(tiers):
    t = tiers
    t.compute([key(0), key(1), ("req-1", 0)])

    def snap() -> tuple:
        return t.cpu.entries(), t.disk.entries(), t.remote.entries(), t.chain.open_moves

    before = snap()
    with pytest.raises(BlockStateError, match=r"keys\[1\] = .* is not ready in the CPU tier"):
        t.chain.demote(0, [key(0), key(5)])
    with pytest.raises(InvalidArgumentError, match=r"cannot be stored in the DISK store"):
        t.chain.demote(0, [key(0), ("req-1", 0)])
    with pytest.raises(InvalidArgumentError, match=r"src must be a tier index in \[0, 1\]"):
        t.chain.demote(2, [key(0)])
    with pytest.raises(InvalidArgumentError, match=r"src must be a tier index in \[1, 2\]"):
        t.chain.stage([key(0)], 0)
    with pytest.raises(BlockStateError, match="is not ready in the DISK tier"):
        t.chain.stage([key(0)], 1)
    assert snap() == before
    move = t.chain.demote(0, [key(0)])
    with pytest.raises(InvalidArgumentError, match="which move 0 does not copy"):
        t.chain.finish(move, [key(1)])
    engine = ControlledCopyEngine()
    handle = engine.submit(move.plan(99))
    with pytest.raises(BlockStateError, match="is not final yet"):
        t.chain.finish_handle(move, handle)
    assert t.chain.open_moves == [move] and t.cpu.num_pinned == 1
    assert t.chain.finish(move, []) == []  # nothing landed: both sides roll back
    with pytest.raises(BlockStateError, match="move 0 is not open"):
        t.chain.finish(move, [])
    assert snap() == before


def test_a_chain_is_checked_when_it_is_built(tmp_path):
    cpu, cpu2 = CPUStore(4), CPUStore(4)
    with pytest.raises(InvalidArgumentError, match="distinct media"):
        TierChain([(cpu, WB), (cpu2, NONE)])
    with pytest.raises(InvalidArgumentError, match=r"the last tier \(CPU\) has no tier below it"):
        TierChain([(cpu, WB)])
    with pytest.raises(InvalidArgumentError, match="must be a non-empty list"):
        TierChain([])
    with pytest.raises(InvalidArgumentError, match=r"tiers\[0\]\[1\] must be a TierPolicy"):
        TierChain([(cpu, "write_back")])
    with pytest.raises(InvalidArgumentError, match=r"TierPolicy\.demote must be one of"):
        TierPolicy("lazy")
    assert TierChain([(cpu, NONE)]).route(0) == ("CPU", "GPU")
