"""Copies in flight: the plans, the GPU blocks they hold, and their completions.

One owner for "what is being copied right now".  A copy that reads GPU blocks
holds a reference on each of them for as long as it runs, so the pool can never
hand such a block to a new owner (a held block is not in the free queue): that
is the whole defence against serving KV that a copy was still reading.  The
tier manager decides *what* moves and what a completion means; this module
only submits, tracks, holds and hands back.

The copy engine is foreign code.  Whatever it raises from ``submit`` becomes a
handle that is already FAILED, settled by the next ``finished()`` like any
other failure, so a broken engine can never leave a request half-moved.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.block_pool import BlockPool
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.errors import PlanError
from tiered_kv.transfer.engine import CopyEngine
from tiered_kv.transfer.plan import PlanKind, TransferHandle, TransferPlan, TransferStatus


@dataclass(slots=True, eq=False)
class Transfer:
    """One plan in flight.

    Attributes:
        plan: What is copied.
        handle: The engine's handle (already final if the engine refused it).
        gpu_holds: GPU blocks the copy reads, each held once by it.
        in_place: Give the holds back where the blocks were in the free queue
            (a save before eviction), instead of by the caching rule.
        payload: What the tier manager needs to settle the copy.
        engine: The engine it was submitted to, when not the GPU<->CPU copy engine
            (the I/O engine of a tier below the CPU).
    """

    plan: TransferPlan
    handle: TransferHandle
    gpu_holds: list[KVCacheBlock] = field(default_factory=list)
    in_place: bool = False
    payload: Any = None  # mypyc's dataclasses cannot annotate a field with `object`
    engine: CopyEngine | None = None

    @property
    def ok(self) -> bool:
        return self.handle.ok

    @property
    def cancelled(self) -> bool:
        return self.handle.status is TransferStatus.CANCELLED


class Transfers:
    """Plans in flight over one copy engine and one GPU pool, in plan-id order."""

    def __init__(self, engine: CopyEngine, gpu_pool: BlockPool) -> None:
        self.engine = engine
        self.gpu_pool = gpu_pool
        self._live: dict[int, Transfer] = {}
        self._ids = count(1)  # plan ids, in the order plans are made
        self.submitted = 0

    def plan(
        self,
        src_medium: str,
        dst_medium: str,
        src_ids: Sequence[int],
        dst_ids: Sequence[int],
        kind: PlanKind,
        request_id: Hashable | None,
        urgent: bool = False,
        num_layers: int = 0,
        gated: bool = False,
    ) -> TransferPlan:
        """A new plan with the next id (not submitted yet).

        ``num_layers`` > 0: copied and reported layer by layer; ``gated``: each
        layer waits until compute opens it (see ``TransferPlan.gated``).
        """
        return TransferPlan(
            next(self._ids),
            src_medium,
            dst_medium,
            tuple(src_ids),
            tuple(dst_ids),
            kind,
            request_id,
            urgent,
            num_layers=num_layers,
            gated=gated,
        )

    def start(
        self,
        plan: TransferPlan,
        gpu_holds: Sequence[KVCacheBlock] = (),
        in_place: bool = False,
        payload: object = None,
        engine: CopyEngine | None = None,
    ) -> Transfer:
        """Hold ``gpu_holds`` and submit ``plan`` to ``engine`` (default: the copy engine); a raise is a failed copy."""
        holds = list(gpu_holds)
        if holds:
            self.gpu_pool.touch(holds)
        try:
            handle = (self.engine if engine is None else engine).submit(plan)
            if not isinstance(handle, TransferHandle) or handle.plan != plan:
                raise PlanError(f"copy engine returned {handle!r} for plan {plan.plan_id}, not its handle")
        except Exception as exc:
            handle = TransferHandle(plan)
            handle.finish(TransferStatus.FAILED, exc)
        t = Transfer(plan, handle, holds, in_place, payload, engine)
        self._live[plan.plan_id] = t
        self.submitted += 1
        return t

    def release(self, t: Transfer) -> list[KVCacheBlock]:
        """Give back the GPU blocks a settled copy held; return them (each lost a holder)."""
        holds = t.gpu_holds
        if not holds:
            return holds
        if t.in_place:
            self.gpu_pool.release_in_place(holds)
        else:
            self.gpu_pool.free_blocks(holds[::-1])
        t.gpu_holds = []
        return holds

    def finished(self) -> list[Transfer]:
        """Take every transfer whose handle is final, in plan order."""
        done = [t for pid, t in sorted(self._live.items()) if t.handle.done()]
        for t in done:
            del self._live[t.plan.plan_id]
        return done

    def take(self, handle: TransferHandle) -> Transfer:
        """Take the transfer of one final handle.

        Raises:
            PlanError: the plan is not in flight (unknown or settled already),
                is not final, differs from the plan emitted under its id, or ran
                on another engine than the copy engine (a move between tiers
                below the GPU, which only :meth:`finished` hands out).
        """
        plan = handle.plan
        t = self._live.get(plan.plan_id)
        if t is None:
            raise PlanError(f"plan {plan.plan_id} is not in flight (unknown or already completed)")
        if t.engine is not None:
            raise PlanError(f"plan {plan.plan_id} moves blocks below the GPU ({plan.src_medium} -> {plan.dst_medium})")
        if plan != t.plan:
            raise PlanError(
                f"plan {plan.plan_id} does not match the plan emitted for request {t.plan.request_id!r}: "
                f"ids {plan.src_block_ids}->{plan.dst_block_ids} vs {t.plan.src_block_ids}->{t.plan.dst_block_ids}"
            )
        if not handle.done():
            raise PlanError(f"plan {plan.plan_id} is not finished yet")
        del self._live[plan.plan_id]
        return t

    def cancel(self, plan_id: int) -> bool:
        """Ask the engine to cancel; True when the handle is now final (cancelled, or finished first)."""
        t = self._live[plan_id]
        try:
            (self.engine if t.engine is None else t.engine).cancel(t.handle)
        except Exception:  # a foreign engine that cannot cancel: the copy runs on
            pass
        return t.handle.done()

    def get(self, plan_id: int) -> Transfer | None:
        return self._live.get(plan_id)

    def __iter__(self) -> Iterator[Transfer]:
        return iter([self._live[k] for k in sorted(self._live)])

    def __len__(self) -> int:
        return len(self._live)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until some copy in flight is final (or ``timeout``); False if none is in flight."""
        live = list(self._live.values())
        if not live:
            return False
        if any(t.handle.done() for t in live):
            return True
        return live[0].handle.wait(timeout) or live[0].handle.done()

    def blocks_freed_on_completion(self, gpu: KVCacheManager) -> int:
        """GPU blocks that return to the free queue when the copies in flight settle.

        A swap-out frees its victim's exclusive blocks; a store frees the blocks
        only it still holds (their request finished, or they were saved before
        eviction).
        """
        n = 0
        for t in self._live.values():
            if t.plan.kind is PlanKind.SWAP_OUT:
                n += sum(1 for b in gpu.get_blocks(t.plan.request_id) if b.ref_cnt == 1)
            else:
                n += sum(1 for b in t.gpu_holds if b.ref_cnt == 1)
        return n

    def gpu_hold_counts(self) -> dict[int, int]:
        """GPU block id -> holds by copies in flight (for the manager's ownership check)."""
        return Counter(b.block_id for t in self._live.values() for b in t.gpu_holds)
