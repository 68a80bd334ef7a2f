"""The real engine's settings: one frozen record, checked whole before the engine allocates anything."""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.core.hashing import get_hash_fn
from tiered_kv.manager.victim_policy import VictimPolicy
from tiered_kv.sched import SchedulerConfig
from tiered_kv.storage.spec import LAYOUTS
from tiered_kv.tiers.write_policy import check_write_policy


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How an :class:`~tiered_kv.engine.engine.Engine` is sized and scheduled.

    The tiers below the CPU are not here: they are the engine's ``tiers``
    argument, a list of :class:`~tiered_kv.tiers.tier_kind.TierConfig`.  The
    GPU and CPU tiers stay here because the engine allocates their tensors
    itself and the manager's pools are sized from them; every tier below the
    CPU is built by its own kind.

    Attributes:
        num_gpu_blocks / num_cpu_blocks: Tier sizes (null block included); 0 CPU blocks: no CPU tier.
        block_size: Tokens per block.
        layout: KV layout of both tiers.
        victim_policy / mode: The scheduler's preemption victim policy (a name, a
            qualified class name or a ``VictimPolicy`` instance: see
            :attr:`SchedulerConfig.victim_policy`) and preemption mode.
        policy: The scheduling order, ``"fcfs"`` or ``"priority"`` (vLLM's meaning of the word).
        max_num_batched_tokens / max_num_seqs / chunked_prefill: The scheduler's step budget.
        offload / evict_window: When GPU blocks are also written to the CPU tier
            (:mod:`~tiered_kv.tiers.write_policy`) and, for ``"write_back"``, how
            many blocks at the front of the GPU free queue are kept written.
        device: Where the GPU tier lives (default: CUDA when available, else the CPU).
        record_logits: Keep the logits every sampled token came from.
        hash_fn: The block hash (``"sha256"``, ``"fast"``, ``"xxh3_128"``).
        layerwise: Move KV layer by layer.  A resumed request computes in the
            step its load starts, layer ``i`` waiting only for layer ``i`` of
            the load (on CUDA the compute stream waits on the layer's event; on
            the CPU the host waits for the layer).  With write-through, a
            prefill's blocks are stored layer by layer as the forward pass writes them.
        metrics_port: Serve Prometheus metrics on this port of 127.0.0.1 (0: a
            free port).  Needs the metrics extra.

    Raises:
        InvalidArgumentError: any bad field (the message names it), at construction.
    """

    num_gpu_blocks: int = 64
    num_cpu_blocks: int = 256
    block_size: int = 4
    layout: str = "block_contiguous"
    victim_policy: str | VictimPolicy = "last_admitted"
    mode: str = "auto"
    policy: str = "fcfs"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    chunked_prefill: bool = True
    offload: str = "none"
    evict_window: int = 64
    device: str | None = None
    record_logits: bool = False
    hash_fn: str = "sha256"
    layerwise: bool = False
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        checks.count("num_gpu_blocks", self.num_gpu_blocks, 1)
        checks.count("num_cpu_blocks", self.num_cpu_blocks)
        checks.count("block_size", self.block_size, 1)
        checks.choice("layout", self.layout, LAYOUTS)
        check_write_policy("offload", self.offload)
        checks.count("evict_window", self.evict_window)
        if self.device is not None:
            checks.instance("device", self.device, str)
        checks.flag("record_logits", self.record_logits)
        get_hash_fn(self.hash_fn)
        self.scheduler_config()
        if self.metrics_port is not None:
            from tiered_kv.obs.prometheus import check_port

            check_port(self.metrics_port)

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's part of these settings."""
        return SchedulerConfig(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.chunked_prefill,
            policy=self.policy,
            victim_policy=self.victim_policy,
            mode=self.mode,
            layerwise=self.layerwise,
        )
