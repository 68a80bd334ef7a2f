"""The real engine's settings: one frozen record, checked whole before the engine allocates anything."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.manager_config import ManagerConfig
from tiered_kv.sched import SchedulerConfig
from tiered_kv.storage.spec import LAYOUTS


def _default_manager() -> ManagerConfig:
    return ManagerConfig(num_gpu_blocks=64, num_cpu_blocks=256, block_size=4)


def _default_scheduler() -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How an :class:`~tiered_kv.engine.engine.Engine` is sized and scheduled.

    The engine holds the manager's and the scheduler's own configs rather than
    copies of their fields; what is here is the engine's alone.  The tiers
    below the CPU are not here: they are the engine's ``tiers`` argument, a
    list of :class:`~tiered_kv.tiers.tier_kind.TierConfig`.  The GPU and CPU
    tiers' sizes are the manager's because the engine allocates their tensors
    from them; every tier below the CPU is built by its own kind.

    Attributes:
        manager: Tier sizes and policies (:class:`~tiered_kv.manager.ManagerConfig`):
            64 GPU blocks, 256 CPU blocks (0: no CPU tier), 4 tokens a block by
            default.  Its ``hash_fn`` must be a name (it names the tiers' key space).
        scheduler: Budget, scheduling order, victim policy, preemption mode and
            layer-wise loading (:class:`~tiered_kv.sched.SchedulerConfig`):
            512 tokens and 32 requests a step by default.  With ``layerwise``,
            a resumed request computes in the step its load starts, layer ``i``
            waiting only for layer ``i`` of the load (on CUDA the compute
            stream waits on the layer's event; on the CPU the host waits for
            the layer); with write-through, a prefill's blocks are stored layer
            by layer as the forward pass writes them.
        layout: KV layout of both tiers.
        device: Where the GPU tier lives (default: CUDA when available, else the CPU).
        record_logits: Keep the logits every sampled token came from.
        metrics_port: Serve Prometheus metrics on this port of 127.0.0.1 (0: a
            free port).  Needs the metrics extra.

    Raises:
        InvalidArgumentError: any bad field (the message names it), at construction.
    """

    manager: ManagerConfig = field(default_factory=_default_manager)
    scheduler: SchedulerConfig = field(default_factory=_default_scheduler)
    layout: str = "block_contiguous"
    device: str | None = None
    record_logits: bool = False
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        checks.instance("manager", self.manager, ManagerConfig)
        checks.instance("scheduler", self.scheduler, SchedulerConfig)
        if not isinstance(self.manager.hash_fn, str):
            raise InvalidArgumentError(
                f"manager.hash_fn must be a hash function's name (it names the tiers' key space), "
                f"got {checks.describe(self.manager.hash_fn)}"
            )
        checks.choice("layout", self.layout, LAYOUTS)
        if self.device is not None:
            checks.instance("device", self.device, str)
        checks.flag("record_logits", self.record_logits)
        if self.metrics_port is not None:
            from tiered_kv.obs.prometheus import check_port

            check_port(self.metrics_port)
