"""The tier manager with a disk tier below its CPU store: lookups, staged loads, pricing, demotion, faults, misuse.

The GPU<->CPU copies run on the controlled engine (the test decides when they
land); the disk tier is real (files under a temporary directory, real I/O
threads), and a fault hook holds or fails its I/O where a test needs that.
"""

from __future__ import annotations

import errno
import threading

import pytest
from mgrutil import cq, make_tm, run, tm_snapshot
from poolutil import letters
from tierutil import NS, host

from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, PlanError, StorageError, TieredKVError
from tiered_kv.manager import Residency
from tiered_kv.manager.pricing import ConfigError, CostModel, price_load
from tiered_kv.manager.tier_moves import RETRY_POLLS
from tiered_kv.sched import Scheduler
from tiered_kv.sched.status import RequestStatus
from tiered_kv.tiers.chain import TierPolicy
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.kinds.disk import DiskTierConfig
from tiered_kv.tiers.kinds.redis import RedisTierConfig
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.lower_tier import LowerTier
from tiered_kv.transfer.plan import CPU, PlanKind

SLOT = 4096  # a 512-byte block's file, rounded up to the allocation unit


class Gate:
    """A fault hook that holds every disk load until opened, and can fail stores."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.store_error: int | None = None
        self.stores = 0

    def __call__(self, op: str, key) -> None:
        if op == "load":
            assert self.open.wait(30), "a test left a load held"
        else:
            self.stores += 1
            if self.store_error is not None:
                raise OSError(self.store_error, "injected")


class Setup:
    """A manager (GPU 9, CPU 4 blocks of 4 tokens) with a disk tier of 16 blocks below its CPU store."""

    def __init__(self, tmp_path, demote: str = "write_through", link=None, cpu: int = 5, disk_blocks: int = 16):
        self.tm, self.eng = make_tm(gpu=9, cpu=cpu, offload="write_through")
        self.gate = Gate()
        self.disk = DiskStore(tmp_path, NS, disk_blocks * SLOT)
        self.io = DiskIO(host(num_blocks=cpu), self.disk, fault_hook=self.gate)
        self.tm.attach_tiers([LowerTier(self.disk, self.io, link or DiskTierConfig.default_link, demote, 16)])

    def settle(self) -> list:
        """Land every copy (the controlled ones at once, the disk ones when their threads finish) and poll."""
        done = []
        for _ in range(1000):
            self.eng.complete_all()
            done += self.tm.poll()
            if not self.tm.plans_in_flight():
                return done
            self.eng.complete_all()
            self.tm.wait(10)
        raise AssertionError("copies kept coming")

    def prefix_on_disk_only(self) -> Request:
        """P's three prompt blocks computed, written through to the CPU and on to disk, then evicted from both."""
        p = run(self.tm, "P", "AAAABBBBCCCCD")
        self.settle()
        self.tm.free("P")
        assert self.disk.num_used == 3
        for i, text in enumerate(("ffffgggghhhhi", "jjjjkkkkllllm", "nnnnoooopppps")):  # evict P from CPU and GPU
            run(self.tm, f"F{i}", text)
            self.settle()
            self.tm.free(f"F{i}")
        assert not any(self.tm.store.contains(k) for k in p.block_hashes[:3])
        assert self.tm.gpu.block_pool.get_cached_block(p.block_hashes[0]) is None
        return p

    def close(self) -> None:
        self.io.close()
        self.disk.close()


@pytest.fixture
def setup(tmp_path):
    s = Setup(tmp_path)
    yield s
    s.gate.open.set()
    s.close()


def test_a_prefix_on_disk_is_staged_through_the_cpu_tier_then_loaded_while_the_request_is_loading(setup):
    s = setup
    p = s.prefix_on_disk_only()
    s.gate.open.clear()  # hold the disk reads
    q = Request("Q", letters("AAAABBBBCCCCX"))
    res = s.tm.admit(q, q.num_tokens)
    assert (res.num_computed_tokens, res.num_loading_tokens, res.num_new_tokens, res.runnable) == (0, 12, 1, False)
    assert (res.plan.src_medium, res.plan.dst_medium, res.plan.kind) == ("DISK", CPU, PlanKind.ONBOARD)
    assert s.tm.residency("Q") is Residency.LOADING
    # Mid-flight: the disk blocks are pinned, their CPU slots pending; nothing can evict or reuse either.
    assert sum(e.endswith("~") for e in cq(s.tm)) == 3
    assert s.disk.num_pinned == 3 and s.tm.store.num_pending == 3
    s.tm.check_invariants()
    assert s.tm.cancel("Q") is False  # a staged load is not cancelled; it settles as what it is
    with pytest.raises(InvalidTransitionError, match="loading"):
        s.tm.free("Q")
    s.gate.open.set()
    done = s.settle()
    (c,) = [x for x in done if x.request_id == "Q"]
    assert (c.kind, c.ok, c.num_tokens, c.residency) == (PlanKind.ONBOARD, True, 12, Residency.GPU)
    assert s.tm.gpu.block_pool.get_cached_block(p.block_hashes[2]) is not None  # loaded blocks are cached
    m = s.tm.metrics()
    d = m.lower_tiers["DISK"]
    assert (d.hit_blocks, d.loaded_blocks, d.load_failed_blocks, d.declined_blocks) == (3, 3, 0, 0)
    assert m.counters.onboard_blocks == 3 and m.counters.cpu_hit_tokens == 12
    assert s.tm.load_log[0].num_blocks == 3 and "from DISK" in s.tm.load_log[0].reason
    s.tm.check_invariants()


def test_a_block_that_fails_to_load_ends_the_prefix_and_the_rest_is_recomputed(setup):
    s = setup
    p = s.prefix_on_disk_only()
    path = s.disk.path_of(p.block_hashes[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a flipped payload byte: the CRC check fails at load
    path.write_bytes(bytes(data))
    q = Request("Q", letters("AAAABBBBCCCCX"))
    assert s.tm.admit(q, q.num_tokens).num_loading_tokens == 12
    (c,) = [x for x in s.settle() if x.request_id == "Q"]
    assert (c.ok, c.num_tokens, c.residency) == (True, 4, Residency.GPU)  # only the block before the bad one
    d = s.tm.metrics().lower_tiers["DISK"]
    assert (d.loaded_blocks, d.load_failed_blocks) == (2, 1)
    assert not s.disk.contains(p.block_hashes[1]) and not path.exists()  # a corrupt block is forgotten
    assert s.tm.store.contains(p.block_hashes[2])  # what landed after it stays cached: nothing found is lost
    s.tm.check_invariants()


def test_when_no_block_lands_the_load_completes_with_nothing_and_the_request_keeps_its_blocks(setup):
    s = setup
    p = s.prefix_on_disk_only()
    s.disk.path_of(p.block_hashes[0]).unlink()  # gone from the medium behind the store's back
    q = Request("Q", letters("AAAABBBBCCCCX"))
    res = s.tm.admit(q, q.num_tokens)
    table = s.tm.gpu_block_ids("Q")
    (c,) = [x for x in s.settle() if x.request_id == "Q"]
    assert (c.kind, c.ok, c.num_tokens, c.residency) == (PlanKind.ONBOARD, True, 0, Residency.GPU)
    assert c.plan_id == res.plan.plan_id and s.tm.gpu_block_ids("Q") == table  # the request is whole, to compute
    assert s.tm.metrics().lower_tiers["DISK"].load_failed_blocks == 1
    s.tm.check_invariants()


def test_a_tier_slower_than_recomputing_is_not_loaded_and_the_log_says_why(tmp_path):
    s = Setup(tmp_path, link=TierLink(bytes_per_s=1e6, block_latency_s=0.5))
    try:
        s.prefix_on_disk_only()
        q = Request("Q", letters("AAAABBBBCCCCX"))
        res = s.tm.admit(q, q.num_tokens)
        assert res.runnable and (res.num_loading_tokens, res.num_new_tokens) == (0, 13)
        (decision,) = s.tm.load_log
        assert decision.num_blocks == 0 and decision.quote.num_declined == 3
        assert decision.reason.startswith("recompute 3 blocks (3 from DISK): loading them would take")
        d = s.tm.metrics().lower_tiers["DISK"]
        assert (d.hit_blocks, d.declined_blocks, d.loaded_blocks) == (3, 3, 0)
        s.tm.check_invariants()
    finally:
        s.close()


def test_write_back_copies_the_cpu_tiers_oldest_blocks_down_before_they_are_evicted(tmp_path):
    s = Setup(tmp_path, demote="write_back")
    try:
        run(s.tm, "P", "AAAABBBBCCCCD")
        s.settle()
        assert s.disk.num_used == 3  # the CPU tier holds 4, so every evictable block is within the reserve
        run(s.tm, "F", "ffffgggghhhhi")
        s.settle()
        m = s.tm.metrics()
        assert m.lower_tiers["DISK"].stored_blocks == 6 and m.chain_lost_blocks == 0
        s.tm.check_invariants()
    finally:
        s.close()


def test_a_full_disk_loses_blocks_counted_and_is_not_retried_at_every_poll(setup):
    s = setup
    s.gate.store_error = errno.ENOSPC
    run(s.tm, "P", "AAAABBBBCCCCD")
    s.settle()
    s.tm.free("P")
    d = s.tm.metrics().lower_tiers["DISK"]
    assert (d.stored_blocks, d.store_failed_blocks) == (0, 3) and s.gate.stores == 3
    for _ in range(RETRY_POLLS - 2):
        s.tm.poll()
    assert s.gate.stores == 3 and not s.tm.plans_in_flight()  # no retry storm
    s.gate.store_error = None
    for _ in range(3):
        s.tm.poll()
    s.settle()
    assert s.tm.metrics().lower_tiers["DISK"].stored_blocks == 3  # tried again once the back-off ran out
    s.gate.store_error = errno.ENOSPC
    run(s.tm, "F", "ffffgggghhhhi")  # its blocks fail to go down, then evict P's and its own from the CPU
    s.settle()
    s.tm.free("F")
    run(s.tm, "G", "jjjjkkkkllllm")
    s.settle()
    assert s.tm.metrics().chain_lost_blocks == 2  # two of F's blocks left the CPU tier with no copy below
    s.tm.check_invariants()


def test_a_prefix_still_being_staged_for_one_request_is_recomputed_by_the_next(setup):
    s = setup
    s.prefix_on_disk_only()
    s.gate.open.clear()
    q, r = Request("Q", letters("AAAABBBBCCCCX")), Request("R", letters("AAAABBBBCCCCY"))
    assert s.tm.admit(q, q.num_tokens).num_loading_tokens == 12
    res = s.tm.admit(r, r.num_tokens)  # Q's blocks are pending on the CPU tier: R cannot load them yet
    assert res.runnable and res.num_loading_tokens == 0
    assert s.tm.metrics().lower_tiers["DISK"].declined_blocks == 3
    s.tm.check_invariants()
    s.gate.open.set()
    (c,) = [x for x in s.settle() if x.request_id == "Q"]
    assert c.ok and c.num_tokens == 12
    s.tm.check_invariants()


def test_write_back_from_disk_to_a_remote_tier_passes_through_the_cpu_tier_and_leaves_it(tmp_path):
    fakeredis = pytest.importorskip("fakeredis")
    from tiered_kv.tiers.redis_io import RedisIO
    from tiered_kv.tiers.redis_store import RedisStore

    tm, eng = make_tm(gpu=9, cpu=5, offload="write_through")
    disk = DiskStore(tmp_path, NS, 16 * SLOT)
    remote = RedisStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()), NS, index_blocks=64)
    down = {"on": True}

    def hook(op, key):
        if down["on"]:
            raise ConnectionError("injected: the server is down")

    cpu_host = host(num_blocks=5)
    io = {"DISK": DiskIO(cpu_host, disk), "REMOTE": RedisIO(cpu_host, remote, fault_hook=hook)}
    tm.attach_tiers(
        [
            LowerTier(disk, io["DISK"], DiskTierConfig.default_link, "write_through"),
            LowerTier(remote, io["REMOTE"], RedisTierConfig.default_link, "write_back", 16),
        ]
    )
    s = Setup.__new__(Setup)  # reuse its settle loop over this manager
    s.tm, s.eng = tm, eng
    try:
        p = run(tm, "P", "AAAABBBBCCCCD")
        s.settle()
        tm.free("P")
        keys = list(p.block_hashes[:3])
        m = tm.metrics().lower_tiers
        assert m["DISK"].stored_blocks == 3 and m["REMOTE"].store_failed_blocks == 3  # straight from the CPU tier
        for i, text in enumerate(("ffffgggghhhhi", "jjjjkkkkllllm")):  # P leaves the CPU tier; the server is back
            run(tm, f"F{i}", text)
            s.settle()
            tm.free(f"F{i}")
        assert not any(tm.store.contains(k) for k in keys) and all(disk.contains(k) for k in keys)
        down["on"] = False
        for _ in range(RETRY_POLLS):  # the back-off runs out: P's blocks go disk -> CPU -> remote
            tm.poll()
        s.settle()
        assert all(remote.contains(k) for k in keys)
        assert not any(tm.store.contains(k) for k in keys)  # only passed through the CPU tier
        m = tm.metrics().lower_tiers
        # P's three at least were staged (their passage may push F's blocks out of the CPU tier: those follow).
        assert m["DISK"].loaded_blocks >= 3 and m["REMOTE"].stored_blocks >= m["DISK"].loaded_blocks
        assert m["REMOTE"].store_failed_blocks >= 3 and tm.metrics().chain_lost_blocks == 0
        tm.check_invariants()
    finally:
        for engine in io.values():
            engine.close()
        disk.close()


def test_a_request_aborted_while_its_prefix_is_staged_is_dropped_once_the_load_settles(setup):
    s = setup
    s.prefix_on_disk_only()
    s.gate.open.clear()
    sched = Scheduler(s.tm)
    sched.add_request(Request("Q", letters("AAAABBBBCCCCX")))
    sched.schedule()
    assert sched.status["Q"] is RequestStatus.ARRIVING and s.tm.state("Q").residency is Residency.LOADING
    sched.abort("Q")  # its staging cannot be cancelled: the request goes when its load settles
    assert s.tm.holds("Q") and sched.num_unfinished == 1
    s.gate.open.set()
    for _ in range(1000):
        s.eng.complete_all()
        sched.settle()
        if not sched.num_unfinished:
            break
        s.tm.wait(1)
    assert sched.num_unfinished == 0 and not s.tm.holds("Q")
    s.tm.check_invariants()
    assert s.tm.store.num_pinned == 0 and s.disk.num_pinned == 0  # nothing it touched stays held


def test_a_staging_move_cannot_be_settled_out_of_band(setup):
    s = setup
    s.prefix_on_disk_only()
    s.gate.open.clear()
    q = Request("Q", letters("AAAABBBBCCCCX"))
    res = s.tm.admit(q, q.num_tokens)
    handle = s.tm.handle(res.plan.plan_id)
    s.gate.open.set()
    assert handle.wait(10)
    before = tm_snapshot(s.tm)
    with pytest.raises(PlanError, match="below the GPU"):
        s.tm.process_completion(handle)
    assert tm_snapshot(s.tm) == before
    s.settle()


def test_bad_tiers_are_refused_and_change_nothing(tmp_path):
    tm, _eng = make_tm(offload="write_through")
    disk = DiskStore(tmp_path / "d", NS, 8 * SLOT)
    io = DiskIO(host(), disk)
    link = DiskTierConfig.default_link
    good = [LowerTier(disk, io, link, "write_back", 8)]
    other_disk = DiskStore(tmp_path / "e", NS, 8 * SLOT)
    before = tm_snapshot(tm)
    cases = [
        ([LowerTier(tm.store, io, link)], "each tier below the CPU needs its own store"),
        ([LowerTier(disk, io, link), LowerTier(disk, io, link)], "each tier below the CPU needs its own store"),
        ([], "no tier below the CPU"),
        (
            [LowerTier(disk, io, link, "write_back", 9)],
            r"tiers\[0\]\.writeback_reserve is 9, more than the DISK tier holds \(8 blocks\)",
        ),
        ("chain", "tiers must be a list of LowerTier entries"),
        ([disk], r"tiers\[0\] must be a LowerTier"),
        (
            [LowerTier(disk, io, link), LowerTier(other_disk, io, link)],
            r"tiers must have distinct media, got \['CPU', 'DISK', 'DISK'\]",
        ),
    ]
    for tiers, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            tm.attach_tiers(tiers)
        assert tm_snapshot(tm) == before and tm.load_log == [] and tm.store.enable_events is False
    with pytest.raises(InvalidArgumentError, match=r"LowerTier.io must have submit\(\) and cancel\(\)"):
        LowerTier(disk, object(), link)
    with pytest.raises(InvalidArgumentError, match=r"LowerTier.link must be a TierLink"):
        LowerTier(disk, io, (1e9, 0))
    with pytest.raises(
        InvalidArgumentError, match=r"LowerTier.write_policy must be one of .*'on_evict' is now 'write_back'"
    ):
        LowerTier(disk, io, link, "on_evict")
    no_cpu, _ = make_tm(cpu=0)
    with pytest.raises(InvalidArgumentError, match="need a CPU tier"):
        no_cpu.attach_tiers(good)
    tm.attach_tiers(good)
    with pytest.raises(InvalidTransitionError, match="attached already"):
        tm.attach_tiers(good)
    with pytest.raises(InvalidArgumentError, match="demote"):
        TierPolicy("sideways")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StorageError, match="cannot use directory") as err:
        DiskStore(blocker / "under", NS, 8 * SLOT)  # a directory that cannot be made (a file is in the way)
    assert isinstance(err.value, TieredKVError)
    io.close()
    disk.close()
    other_disk.close()


# ------------------------------------------------------------ pricing


def test_a_load_quote_loads_the_prefix_that_minimises_load_plus_recompute():
    # 4 KiB blocks of 4 tokens: 1 ms a block to the GPU, 1 ms a token (4 ms a block) to recompute.
    cm = CostModel(1024, 4, h2d_bytes_per_s=4096e3, per_copy_overhead_s=0.0, prefill_tokens_per_s=1000.0)
    fast, slow = TierLink(4096e3, 0.0), TierLink(4096e3, 0.010)  # 1 ms a block into the CPU tier; 11 ms
    both = price_load(cm, "r", ["CPU", "DISK", "REMOTE"], [None, fast, slow], 0, 13)
    assert both.num_blocks == 2 and both.num_declined == 1  # CPU 1 ms + DISK 2 ms a block < 4 ms; REMOTE 12 ms > 4
    assert both.load_s == pytest.approx(0.003) and both.saved_s == pytest.approx(0.008)
    assert both.rest_load_s == pytest.approx(0.012) and both.rest_recompute_s == pytest.approx(0.004)
    assert both.reason.startswith("recompute 1 blocks (1 from REMOTE)")
    # With attention's quadratic term a later block saves more than an earlier one: at 5 ms a block, the
    # first alone is not worth loading (saves 4.8 ms) but the two together are (save 11.2 ms): the prefix decides.
    quad = CostModel(
        1024,
        4,
        h2d_bytes_per_s=4096e3,
        per_copy_overhead_s=0.0,
        prefill_tokens_per_s=1000.0,
        prefill_quadratic_s_per_token2=1e-4,
    )
    two = price_load(quad, "r", ["DISK"] * 2, [TierLink(4096e3, 0.003)] * 2, 0, 9)
    one = price_load(quad, "r", ["DISK"], [TierLink(4096e3, 0.003)], 0, 9)
    assert (two.num_blocks, one.num_blocks) == (2, 0)
    assert two.reason.startswith("load 2 blocks (2 from DISK)") and one.reason.startswith("recompute 1 blocks")
    with pytest.raises(ConfigError, match="bytes_per_s must be > 0"):
        TierLink(0, 1e-6)
    with pytest.raises(ConfigError, match="block_latency_s must be a finite number"):
        TierLink(1e9, float("nan"))
