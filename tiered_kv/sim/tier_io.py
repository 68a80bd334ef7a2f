"""Tiers below the CPU on simulated time: real stores and chain, I/O that completes when the tier's link says.

The simulator attaches its tiers to the manager as the real engine does
(:class:`~tiered_kv.tiers.lower_tier.LowerTier` entries, through
:meth:`TierManager.attach_tiers <tiered_kv.manager.TierManager.attach_tiers>`,
which orders them into its :class:`~tiered_kv.tiers.chain.TierChain`),
so what is looked up, staged, demoted, pinned and evicted is exactly what a
real run does.  Only the bytes are missing, as they are on the simulated CPU
tier: a :class:`SimTierStore` is the disk and remote stores' bookkeeping
(:class:`~tiered_kv.tiers.keyed_store.KeyedStore`) with no medium behind it,
and a :class:`SimTierIO` is an I/O engine that moves nothing and finishes each
plan at the simulated time its link gives.

What a plan costs: a tier has one lane for loads (medium -> CPU tier) and one
for stores (CPU tier -> medium), like the real engines' separate load and store
pools.  Each lane serves its plans in order, each taking the load time of the
lane's :class:`~tiered_kv.tiers.link.TierLink` (the manager prices loads with
the same link).  A load to the GPU is then the manager's usual ONBOARD copy,
CPU -> GPU over the simulated PCIe link.  The two lanes of one medium do not
slow each other down: a load running beside a write-back is charged as if it
had the medium to itself, so loads are optimistic while a tier is being filled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import PlanError
from tiered_kv.manager.metrics import MetricsSnapshot
from tiered_kv.manager.tier_manager import TierManager
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.tier_config import SimTier, TierSetup
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.io_handle import BlockIOHandle, BlockOutcome
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.lower_tier import LowerTier
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus

EVENT = "tier_io"
"""The kind of the event loop's events that finish a tier's plan (the simulator hands them to :func:`on_event`)."""


class SimTierStore(KeyedStore):
    """The bookkeeping of a store below the CPU tier (a disk, a remote server), with no medium behind it.

    Args:
        medium: The tier kind's medium (``"DISK"``, ``"REMOTE"``, ...).
        capacity: Blocks it holds.
    """

    def __init__(self, medium: str, capacity: int) -> None:
        checks.count("capacity", capacity, 1)
        super().__init__(capacity + 1)  # slot 0 is reserved, as in every store
        self.medium = medium


@dataclass(slots=True, eq=False)
class TierIOJob:
    """One plan on a tier's lane: when it started and ends (simulated seconds)."""

    engine: SimTierIO
    handle: BlockIOHandle
    op: str
    submitted: float
    start: float
    end: float


class SimTierIO:
    """The I/O engine of one simulated tier: checks a plan as the real engines do, finishes it on the event loop.

    Args:
        loop: The simulator's event loop (its clock).
        store: The tier's store (its slots name the plan's keys).
        host: The CPU store, the staging area (its medium and slot count bound the plan's CPU side).
        tier: The tier's links.
        bytes_per_block: KV bytes of one block.

    Attributes:
        jobs: Every plan, in submission order, with its simulated start and end.
    """

    def __init__(
        self, loop: EventLoop, store: SimTierStore, host: CPUStore, tier: SimTier, bytes_per_block: int
    ) -> None:
        checks.count("bytes_per_block", bytes_per_block, 1)
        self.loop = loop
        self.store = store
        self.host = host
        self.tier = tier
        self.bytes_per_block = bytes_per_block
        self.lane_free_at = {"load": 0.0, "store": 0.0}
        self.jobs: list[TierIOJob] = []

    @property
    def medium(self) -> str:
        return self.store.medium

    def seconds(self, op: str, num_blocks: int) -> float:
        """Simulated seconds one plan of ``num_blocks`` takes on lane ``op`` (``"load"`` or ``"store"``)."""
        link = self.tier.link.read if op == "load" else self.tier.link.write
        return link.load_time(num_blocks, self.bytes_per_block)  # the same arithmetic either way

    def submit(self, plan: TransferPlan) -> BlockIOHandle:
        """Check the plan, queue it on its lane and schedule its end; return at once.

        Raises:
            PlanError: the plan does not go between the CPU tier and this medium, its ids are
                out of range, or its slots of this store are not reserved for this direction
                (pending for a store, ready for a load).  Nothing is queued.
        """
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {checks.describe(plan)}")
        cpu, medium = self.host.medium, self.medium
        if (plan.src_medium, plan.dst_medium) == (cpu, medium):
            op, slots = "store", plan.dst_block_ids
            plan.validate(self.host.num_blocks, self.store.num_blocks)
        elif (plan.src_medium, plan.dst_medium) == (medium, cpu):
            op, slots = "load", plan.src_block_ids
            plan.validate(self.store.num_blocks, self.host.num_blocks)
        else:
            raise PlanError(f"plan {plan.plan_id}: the {medium} tier moves {cpu} <-> {medium}, not {plan.direction}")
        keys = self.store.plan_keys(plan.plan_id, op, slots)
        now = self.loop.now
        handle = BlockIOHandle(plan, num_bytes=len(keys) * self.bytes_per_block, keys=keys)
        handle.outcomes = [BlockOutcome.CANCELLED] * len(keys)
        handle.status = TransferStatus.RUNNING
        start = max(now, self.lane_free_at[op])
        end = start + self.seconds(op, len(keys))
        self.lane_free_at[op] = end
        job = TierIOJob(self, handle, op, now, start, end)
        self.jobs.append(job)
        self.loop.schedule(end, EVENT, job)
        self.loop.log("tier_io_start", (plan.plan_id, medium, op, len(keys), round(end, 9)))
        return handle

    def cancel(self, handle: TransferHandle) -> bool:
        """A simulated transfer, once queued, runs to its end (the manager never cancels a move of the chain)."""
        return False

    def finish(self, job: TierIOJob) -> None:
        """The job's end has come: every block landed."""
        job.handle.outcomes = [BlockOutcome.OK] * len(job.handle.keys)
        job.handle.finish(TransferStatus.DONE)
        job.handle.elapsed_s = self.loop.now - job.submitted  # simulated, not wall time
        self.loop.log("tier_io_done", job.handle.plan.plan_id)


def on_event(job: TierIOJob) -> None:
    """Handle an :data:`EVENT` of the loop: finish the plan (the manager settles it at its next poll)."""
    job.engine.finish(job)


def attach(tm: TierManager, loop: EventLoop, tiers: TierSetup, bytes_per_block: int) -> dict[str, SimTierIO]:
    """Build the run's tiers below ``tm``'s CPU store and attach them; return each medium's engine (``{}``: none).

    Each tier is a :class:`~tiered_kv.tiers.lower_tier.LowerTier` of a :class:`SimTierStore`,
    a :class:`SimTierIO` and its read link, written to as its entry's ``write_policy`` says.
    """
    host = tm.store
    if not tiers.tiers:
        return {}
    if host is None:
        raise PlanError("tiers below the CPU need the manager's CPU store")
    engines: dict[str, SimTierIO] = {}
    entries = []
    for t in tiers.tiers:
        store = SimTierStore(t.medium, t.num_blocks)
        engines[t.medium] = io = SimTierIO(loop, store, host, t, bytes_per_block)
        entries.append(LowerTier(store, io, t.link.read, t.write_policy, t.writeback_reserve))
    tm.attach_tiers(entries)
    return engines


def results(m: MetricsSnapshot, engines: Mapping[str, SimTierIO]) -> dict[str, Any]:
    """The run's results about its tiers below the CPU: per tier name, the manager's counters and the lanes' busy time.

    ``hit_blocks``: prefix blocks of admitted requests this was the highest tier to hold;
    ``loaded_blocks``/``stored_blocks``: blocks moved up into / down from the CPU tier;
    ``load_busy_s``/``store_busy_s``: simulated seconds each lane moved data.
    ``chain_lost_blocks``: blocks the CPU tier evicted while no tier below held them.
    """
    tiers: dict[str, dict[str, float]] = {}
    for medium, c in m.lower_tiers.items():
        jobs = engines[medium].jobs if medium in engines else []
        tiers[medium.lower()] = {
            **asdict(c),
            "load_busy_s": sum(j.end - j.start for j in jobs if j.op == "load"),
            "store_busy_s": sum(j.end - j.start for j in jobs if j.op == "store"),
        }
    return {"lower_tiers": tiers, "chain_lost_blocks": m.chain_lost_blocks}
