"""What every engine that moves real bytes shares: validation, coalescing, chunking, lanes.

A plan is validated against the two tiers, coalesced into runs (consecutive on
both sides) and cut into chunks of at most ``max_blocks_per_chunk`` blocks.  It
goes to a *lane*:

* ``h2d_urgent``: swap-ins and onboards (a request waits on them);
* ``h2d``: other host-to-device copies;
* ``d2h``: swap-outs and offloads;
* ``local``: copies within one tier.

Lanes run independently, so a swap-in is never queued behind a swap-out (and
PCIe carries both directions at once); chunking lets other lanes interleave
with a large plan and bounds how long a cancel waits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tiered_kv.errors import PlanError, StorageError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.transfer.plan import CopyRun, TransferHandle, TransferPlan, chunk_runs, coalesce

LANES = ("h2d_urgent", "h2d", "d2h", "local")


def lane_for(plan: TransferPlan) -> str:
    d = plan.direction
    if d == "H2D":
        return "h2d_urgent" if plan.urgent else "h2d"
    if d == "D2H":
        return "d2h"
    return "local"


@dataclass(frozen=True, slots=True)
class PreparedPlan:
    plan: TransferPlan
    lane: str
    chunks: list[list[CopyRun]]
    num_bytes: int

    @property
    def num_copies(self) -> int:
        return sum(len(c) for c in self.chunks)


class StorageEngineBase:
    """Validation, coalescing, chunking and run copies over a ``{"GPU": ..., "CPU": ...}`` tier map.

    Args:
        tiers: The storage of each tier; all share one :class:`KVSpec` and layout.
        max_blocks_per_chunk: Chunk size (blocks).
        record: Keep ``(plan_id, lane, chunk_index, run)`` of every copy in ``trace``.
        copy_hook: Called with ``(plan, run)`` before each run is copied (fault injection).
    """

    def __init__(
        self,
        tiers: Mapping[str, KVStorage],
        max_blocks_per_chunk: int = 64,
        record: bool = False,
        copy_hook: Callable[[TransferPlan, CopyRun], None] | None = None,
    ) -> None:
        specs = {(t.spec, t.layout) for t in tiers.values()}
        if len(specs) != 1:
            raise StorageError(f"all tiers must share one KV spec and layout, got {sorted(map(str, specs))}")
        if max_blocks_per_chunk <= 0:
            raise PlanError(f"max_blocks_per_chunk must be > 0, got {max_blocks_per_chunk}")
        self.tiers = dict(tiers)
        self.spec = next(iter(tiers.values())).spec
        self.layout = next(iter(tiers.values())).layout
        self.max_blocks_per_chunk = max_blocks_per_chunk
        self.trace: list[tuple[int, str, int, CopyRun]] | None = [] if record else None
        self.copy_hook = copy_hook

    def open_layer(self, handle: TransferHandle, layer: int, stream: object = None) -> None:
        """Compute has finished layer ``layer`` of a gated plan's source: its copy may start.

        Layers open in order.  ``stream`` (CUDA engines): the stream whose
        kernels wrote the layer (default: the current one); the copy is ordered
        after it on the device, and the host does not wait.

        Raises:
            PlanError: not a handle, not a gated plan, or not the next layer.
        """
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"open_layer() takes a TransferHandle, got {type(handle).__name__}")
        handle._check_open(layer)
        handle._open(layer)

    def close(self) -> None:
        """Let every submitted plan finish, then release the engine (no-op here; engines override)."""

    def __enter__(self) -> StorageEngineBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    def tier_sizes(self) -> dict[str, int]:
        """Medium name -> blocks of its storage: what its plans may address (a manager checks it was built for them)."""
        return {m: t.num_blocks for m, t in self.tiers.items()}

    def prepare(self, plan: TransferPlan) -> PreparedPlan:
        """Validate (raising :class:`PlanError` before anything is copied), coalesce and chunk."""
        for m in (plan.src_medium, plan.dst_medium):
            if m not in self.tiers:
                raise PlanError(f"plan {plan.plan_id}: this engine has no {m} tier")
        plan.validate(self.tiers[plan.src_medium].num_blocks, self.tiers[plan.dst_medium].num_blocks)
        if plan.num_layers and plan.num_layers != self.spec.num_layers:
            raise PlanError(
                f"plan {plan.plan_id}: a layer-wise plan must cover the {self.spec.num_layers} layers of the KV, "
                f"not {plan.num_layers}"
            )
        runs = coalesce(plan.src_block_ids, plan.dst_block_ids)
        return PreparedPlan(
            plan,
            lane_for(plan),
            chunk_runs(runs, self.max_blocks_per_chunk) if runs else [],
            plan.num_blocks * self.bytes_per_block,
        )

    #: Copy a layer-first run as one strided tensor copy (True) or one copy per contiguous
    #: segment (False).  Same-device copies handle strides natively and fast; cross-device
    #: copies of strided tensors would be staged through a temporary, so CUDA uses segments.
    fuse_strided_runs = True

    def copy_run(self, plan: TransferPlan, run: CopyRun, non_blocking: bool = False) -> None:
        """Copy one run.

        Block-contiguous: a single flat byte-range copy.  Layer-first: one
        strided copy of the run's ``[layers, 2, length, ...]`` view, or
        ``2 * num_layers`` contiguous segment copies (see ``fuse_strided_runs``).
        """
        if self.copy_hook is not None:
            self.copy_hook(plan, run)
        src = self.tiers[plan.src_medium]
        dst = self.tiers[plan.dst_medium]
        if self.layout == "block_contiguous":
            b = self.bytes_per_block
            d0, s0, n = run.dst_start * b, run.src_start * b, run.length * b
            dst.byte_view()[d0 : d0 + n].copy_(src.byte_view()[s0 : s0 + n], non_blocking=non_blocking)
        elif self.fuse_strided_runs:
            dst.run_view(run.dst_start, run.length).copy_(src.run_view(run.src_start, run.length))
        else:
            for d, s in zip(
                dst.run_segments(run.dst_start, run.length), src.run_segments(run.src_start, run.length), strict=True
            ):
                d.copy_(s, non_blocking=non_blocking)

    def copy_run_layer(self, plan: TransferPlan, run: CopyRun, layer: int, non_blocking: bool = False) -> None:
        """Copy one layer (its K and V) of one run: one strided tensor copy per tier view."""
        if self.copy_hook is not None:
            self.copy_hook(plan, run)
        src, dst = self.tiers[plan.src_medium], self.tiers[plan.dst_medium]
        for s, d in zip(src.layer_kv(layer), dst.layer_kv(layer), strict=True):
            d[run.dst_start : run.dst_start + run.length].copy_(
                s[run.src_start : run.src_start + run.length], non_blocking=non_blocking
            )

    def copy_run_raw(
        self, runtime: object, plan: TransferPlan, run: CopyRun, stream: int, layer: int | None = None
    ) -> None:
        """Copy one run (or one layer of it) with one raw CUDA call on ``stream``.

        ``runtime`` is a :class:`~tiered_kv.transfer.cuda_engine.CudaRuntime`.
        Block-contiguous: the whole run is one ``cudaMemcpyAsync``; one layer
        is a ``cudaMemcpy2DAsync`` with a row per block, ``2 * segment_bytes``
        wide (the layer's K then V), the pitch one block.  Layer-first: a run's
        ``2 * num_layers`` pieces (a layer's two) are the rows of one 2-D copy:
        row ``i`` starts at ``(i * num_blocks + start) * segment_bytes`` in each
        tier, so the pitch is the tier's ``num_blocks * segment_bytes`` (see
        :func:`tiered_kv.storage.spec.segment_offsets`).
        """
        if self.copy_hook is not None:
            self.copy_hook(plan, run)
        src, dst = self.tiers[plan.src_medium], self.tiers[plan.dst_medium]
        sb, db, seg = src.kv.data_ptr(), dst.kv.data_ptr(), self.spec.segment_bytes
        if self.layout == "block_contiguous":
            b = self.bytes_per_block
            if layer is None:
                runtime.memcpy_async(db + run.dst_start * b, sb + run.src_start * b, run.length * b, stream)  # type: ignore[attr-defined]
                return
            off = 2 * layer * seg
            runtime.memcpy2d_async(  # type: ignore[attr-defined]
                db + run.dst_start * b + off, b, sb + run.src_start * b + off, b, 2 * seg, run.length, stream
            )
            return
        row, rows = (0, 2 * self.spec.num_layers) if layer is None else (2 * layer, 2)
        runtime.memcpy2d_async(  # type: ignore[attr-defined]
            db + (row * dst.num_blocks + run.dst_start) * seg,
            dst.num_blocks * seg,
            sb + (row * src.num_blocks + run.src_start) * seg,
            src.num_blocks * seg,
            run.length * seg,
            rows,
            stream,
        )

    def _record(self, prep: PreparedPlan, chunk_index: int, run: CopyRun) -> None:
        if self.trace is not None:
            self.trace.append((prep.plan.plan_id, prep.lane, chunk_index, run))
