"""TransferPlan and TransferHandle: the interface between the manager and the copy engines; and a plan's runs.

The manager (layer 2) decides *which* blocks move and emits a plan; a copy
engine (layer 1) moves the bytes asynchronously and reports through a handle.
This module is standard library only, so the manager and its tests never need
torch.

Lifecycle of a handle: ``PENDING`` -> (``RUNNING``) -> ``DONE`` | ``FAILED`` |
``CANCELLED``.  A handle that is not ``DONE`` guarantees the destination holds
nothing the caller may read, and the source was never modified: plans only
read their source.

A plan is copied in *runs*: a run is a maximal stretch where both source and
destination ids increase by one; in the block-contiguous layout it is one
contiguous region on each side, so it becomes one copy call
(:func:`coalesce`, pure arithmetic shared by every engine).  Large plans are cut
into chunks of at most ``max_blocks_per_chunk`` blocks so an urgent small plan
can slip in between (:func:`chunk_runs`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from tiered_kv.errors import PlanError, TransferError

GPU = "GPU"
CPU = "CPU"


class PlanKind(str, enum.Enum):
    """Why a plan exists; engines use it to pick a lane (swap-in is urgent)."""

    SWAP_OUT = "swap_out"  # preemption: GPU -> CPU, GPU blocks freed on completion
    SWAP_IN = "swap_in"  # resume: CPU -> GPU, request runnable on completion
    ONBOARD = "onboard"  # CPU prefix hit for a new request: CPU -> GPU
    OFFLOAD = "offload"  # write-through / on-evict copy of cached blocks: GPU -> CPU
    COPY = "copy"  # anything else (benchmarks, tests)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Copy ``src_block_ids[i]`` of ``src_medium`` to ``dst_block_ids[i]`` of ``dst_medium``.

    Attributes:
        plan_id: Unique per manager; handles and decision logs refer to it.
        request_id: The request the plan serves: a swap's or an onboarding's, and a
            write-through store's (the request whose prompt blocks it stores);
            ``None`` only for an on-evict save, which stores blocks no request holds.
        urgent: Swap-ins and onboards: a request waits on them.
        wait_for: Plan ids that must complete before this one may write its
            destination (on-evict: the old contents must be copied out first).
        num_layers: 0 for a plan that lands as a whole.  Else the plan is
            copied layer by layer and its handle reports each layer as it lands
            (:meth:`TransferHandle.wait_layer`), so compute on layer ``i`` can
            start while later layers are still copying.
        gated: A layer-wise plan whose source compute is still writing: layer
            ``i`` is copied only once the engine's ``open_layer(handle, i)``
            says compute has finished it (layers open in order).  A prefill's
            KV is stored this way while the forward pass is still running.
    """

    plan_id: int
    src_medium: str
    dst_medium: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    kind: PlanKind = PlanKind.COPY
    request_id: Hashable | None = None
    urgent: bool = False
    wait_for: tuple[int, ...] = ()
    num_layers: int = 0
    gated: bool = False

    def __post_init__(self) -> None:
        # Types only; ranges are checked against real pools by ``validate``.  Exact types (a bool is no
        # id).  The ids are checked per block, so there `.__class__ is`, not type(), which costs a global
        # lookup and a call: 109 against 160 ns per check (timeit, CPython 3.11).
        if type(self.plan_id) is not int or self.plan_id < 0:
            raise PlanError(f"plan_id must be an int >= 0, got {self.plan_id!r}")
        for name in ("src_medium", "dst_medium"):
            if type(getattr(self, name)) is not str or not getattr(self, name):
                raise PlanError(f"plan {self.plan_id}: {name} must name a tier, got {getattr(self, name)!r}")
        for name in ("src_block_ids", "dst_block_ids", "wait_for"):
            ids = getattr(self, name)
            if type(ids) is not tuple or not all(i.__class__ is int for i in ids):
                raise PlanError(f"plan {self.plan_id}: {name} must be a tuple of ints, got {ids!r}")
        if not isinstance(self.kind, PlanKind) or type(self.urgent) is not bool:
            raise PlanError(f"plan {self.plan_id}: kind must be a PlanKind and urgent a bool")
        if type(self.num_layers) is not int or self.num_layers < 0:
            raise PlanError(f"plan {self.plan_id}: num_layers must be an int >= 0, got {self.num_layers!r}")
        if type(self.gated) is not bool or (self.gated and not self.num_layers):
            raise PlanError(f"plan {self.plan_id}: gated must be a bool, and a gated plan must be layer-wise")

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)

    @property
    def direction(self) -> str:
        """``"D2H"`` (GPU to CPU), ``"H2D"`` (CPU to GPU), or ``"D2D"``/``"H2H"``."""
        a = "D" if self.src_medium == GPU else "H"
        b = "D" if self.dst_medium == GPU else "H"
        return f"{a}2{b}"

    def validate(self, num_src_blocks: int, num_dst_blocks: int) -> None:
        """Raise :class:`PlanError` unless the plan can be executed against pools of these sizes.

        Checked before anything is copied: equal lengths, ids within range,
        never the null block 0, no destination written twice, and no overlap
        between source and destination within the same tier.
        """
        src, dst = self.src_block_ids, self.dst_block_ids
        if len(src) != len(dst):
            raise PlanError(f"plan {self.plan_id}: {len(src)} source ids but {len(dst)} destination ids")
        for name, ids, limit in (("source", src, num_src_blocks), ("destination", dst, num_dst_blocks)):
            for i in ids:  # per block: `.__class__`, as in __post_init__
                if i.__class__ is not int or not 0 <= i < limit:
                    raise PlanError(f"plan {self.plan_id}: {name} id {i!r} out of range [0, {limit})")
                if i == 0:
                    raise PlanError(f"plan {self.plan_id}: {name} lists the null block 0")
        if len(set(dst)) != len(dst):
            seen: set[int] = set()
            dup = next(i for i in dst if i in seen or seen.add(i))  # type: ignore[func-returns-value]
            raise PlanError(f"plan {self.plan_id}: destination block {dup} listed twice")
        if self.src_medium == self.dst_medium and set(src) & set(dst):
            raise PlanError(f"plan {self.plan_id}: source and destination overlap within {self.src_medium}")


class TransferStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = frozenset({TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.CANCELLED})


@dataclass(eq=False)
class TransferHandle:
    """The caller's view of one submitted plan.

    Two sides use it.  The caller waits (:meth:`wait`, :meth:`result`) and
    reads the status; the engine executing the plan, and only that engine,
    drives it with :meth:`mark_running`, :meth:`finish_layer`,
    :meth:`cancel_if_pending` and :meth:`finish`, which makes it final exactly
    once.  Waiting is on a ``threading.Event``, so a worker thread may complete it.

    Attributes:
        plan: The plan being executed.
        num_bytes: Bytes the plan moves (set by the engine).
        elapsed_s: Seconds from start to finish (set when final).
        error: Why it failed or was cancelled.
    """

    plan: TransferPlan
    num_bytes: int = 0
    status: TransferStatus = TransferStatus.PENDING
    error: BaseException | None = None
    elapsed_s: float = 0.0
    submitted_at: float = field(default_factory=time.perf_counter)
    _event: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _layers: list[threading.Event] = field(default_factory=list, repr=False)
    _landed: set[int] = field(default_factory=set, repr=False)
    _gates: list[threading.Event] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._layers = [threading.Event() for _ in range(self.plan.num_layers)]
        self._gates = [threading.Event() for _ in range(self.plan.num_layers)] if self.plan.gated else []

    @property
    def num_opened(self) -> int:
        """Layers of a gated plan that compute has opened (all of them for any other plan)."""
        if not self._gates:
            return self.plan.num_layers
        return sum(1 for g in self._gates if g.is_set())

    def _check_open(self, layer: int) -> None:
        """Engines: refuse to open a layer out of turn (before anything changes)."""
        if not self._gates:
            raise PlanError(f"plan {self.plan.plan_id} is not gated: it has no layers to open")
        if type(layer) is not int or layer != self.num_opened:
            raise PlanError(
                f"plan {self.plan.plan_id}: layers open in order; the next is {self.num_opened}, not {layer!r}"
            )

    def _open(self, layer: int) -> None:
        """Engines: compute has finished layer ``layer``; its copy may start."""
        self._gates[layer].set()

    def _wait_gate(self, layer: int, timeout: float) -> bool:
        """Engines: wait up to ``timeout`` for layer ``layer`` to be opened."""
        return self._gates[layer].wait(timeout) if self._gates else True

    def layer_done(self, layer: int) -> bool:
        """Whether layer ``layer`` of a layer-wise plan has landed (for a whole plan: whether it is DONE)."""
        return layer in self._landed if self._layers else self.ok

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` has landed (True) or the plan ended without it (False).

        Layers may land in any order; a plan that fails or is cancelled ends
        every layer that had not landed.  For a plan that is not layer-wise
        this is ``wait``.
        """
        if not self._layers:
            return self.wait(timeout)
        self._layers[layer].wait(timeout)
        return layer in self._landed

    def finish_layer(self, layer: int) -> None:
        """Engines: layer ``layer`` landed (its bytes are all in the destination)."""
        with self._lock:
            if self.status in FINAL:
                return
            self._landed.add(layer)
        self._layers[layer].set()

    def done(self) -> bool:
        """True once the handle is final (done, failed or cancelled)."""
        return self._event.is_set()

    @property
    def ok(self) -> bool:
        """True only if the copy completed successfully."""
        return self.status is TransferStatus.DONE

    def wait(self, timeout: float | None = None) -> bool:
        """Block until final or ``timeout``; return whether the copy succeeded."""
        self._event.wait(timeout)
        return self.ok

    def result(self, timeout: float | None = None) -> None:
        """Wait, then raise :class:`TransferError` unless the copy succeeded."""
        if not self._event.wait(timeout):
            raise TransferError(f"plan {self.plan.plan_id}: not finished after {timeout} s")
        if not self.ok:
            raise TransferError(f"plan {self.plan.plan_id} {self.status.value}: {self.error}") from self.error

    def mark_running(self) -> bool:
        """Engines: mark running; False if it was cancelled first."""
        with self._lock:
            if self.status is not TransferStatus.PENDING:
                return False
            self.status = TransferStatus.RUNNING
            return True

    def cancel_if_pending(self, error: BaseException) -> bool:
        """Engines: cancel atomically if no copy has started; a running plan must be stopped by its engine."""
        with self._lock:
            if self.status is not TransferStatus.PENDING:
                return False
            self.status = TransferStatus.CANCELLED
            self.error = error
            self.elapsed_s = time.perf_counter() - self.submitted_at
        self._event.set()
        return True

    def finish(self, status: TransferStatus, error: BaseException | None = None) -> bool:
        """Engines: make the handle final; returns False (and changes nothing) if it already was."""
        assert status in FINAL, status
        with self._lock:
            if self.status in FINAL:
                return False
            self.status = status
            self.error = error
            self.elapsed_s = time.perf_counter() - self.submitted_at
            if status is TransferStatus.DONE:
                self._landed.update(range(len(self._layers)))
        for ev in self._layers:  # every layer that had not landed ends with the plan
            ev.set()
        self._event.set()
        return True


@dataclass(frozen=True, slots=True)
class CopyRun:
    """Copy ``length`` consecutive blocks from ``src_start`` to ``dst_start``."""

    src_start: int
    dst_start: int
    length: int


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[CopyRun]:
    """Merge pairs into runs where both sides are consecutive, preserving plan order."""
    runs: list[CopyRun] = []
    n = len(src)
    i = 0
    while i < n:
        j = i + 1
        while j < n and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append(CopyRun(src[i], dst[i], j - i))
        i = j
    return runs


def count_runs(ids: Sequence[int]) -> int:
    """Runs of consecutive ids on one side: the copies a coalescing engine issues for these blocks.

    An estimate before the other side is known; pricing calls it for every
    preemption candidate, hence the plain loop (about twice as fast as a
    ``pairwise`` generator on a few hundred ids).
    """
    if not ids:
        return 0
    it = iter(ids)
    prev = next(it)
    runs = 1
    for i in it:
        if i != prev + 1:
            runs += 1
        prev = i
    return runs


def chunk_runs(runs: Sequence[CopyRun], max_blocks_per_chunk: int) -> list[list[CopyRun]]:
    """Split runs into chunks of at most ``max_blocks_per_chunk`` blocks, splitting long runs."""
    if max_blocks_per_chunk <= 0:
        raise ValueError(f"max_blocks_per_chunk must be > 0, got {max_blocks_per_chunk}")
    chunks: list[list[CopyRun]] = []
    cur: list[CopyRun] = []
    room = max_blocks_per_chunk
    for run in runs:
        s, d, left = run.src_start, run.dst_start, run.length
        while left:
            take = min(left, room)
            cur.append(CopyRun(s, d, take))
            s += take
            d += take
            left -= take
            room -= take
            if room == 0:
                chunks.append(cur)
                cur = []
                room = max_blocks_per_chunk
    if cur:
        chunks.append(cur)
    return chunks
