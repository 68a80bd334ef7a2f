"""What a :class:`~tiered_kv.manager.TierManager` is built from: one frozen record, checked whole.

The collaborators (the copy engine, the KV spec, the cost model) are the
manager's other arguments; everything that is a setting is here, so the
engine's and the simulator's configs hold one of these instead of copies of
its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.core.hashing import HashFn, get_hash_fn
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.bounded_log import DEFAULT_LOG_SIZE
from tiered_kv.tiers.write_policy import check_write_policy


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """The tier sizes and policies of one tier manager.

    Attributes:
        num_gpu_blocks: GPU pool size, null block included.
        num_cpu_blocks: CPU store size, reserved block 0 included (0: no CPU tier;
            the manager then keeps an empty store, which every store refuses).
        block_size: Tokens per block.
        offload: CPU prefix-tier policy: ``"none"``, ``"write_through"`` (full
            prompt blocks stored once computed) or ``"write_back"`` (cached GPU
            blocks nearing eviction stored first; see ``TierManager.poll``): the
            vocabulary of :mod:`~tiered_kv.tiers.write_policy`, shared with the
            tiers below the CPU.  Without a CPU tier it has nothing to write to.
        store_policy: Eviction policy of the CPU store (``"lru"``, ``"arc"``).
        enable_caching: Prefix caching.  Off: nothing is hashed or cached; swaps
            still work, per request.  ``offload`` needs it.
        hash_fn / hash_seed: Block hashing (shared by both tiers).
        evict_window: With ``offload="write_back"``, how many blocks at the
            eviction end of the GPU free queue are kept stored on the CPU.
        log_size: Entries ``decision_log`` and ``load_log`` keep: the latest
            ones, so a long run's memory does not grow with its requests (each
            log's ``total`` counts every entry); ``None`` keeps all.
        watermark: vLLM 0.33's KV-cache watermark: a fraction in ``[0, 1)`` of
            the GPU pool (null block included) that an admission must leave
            free while other requests run; ``0.0``, vLLM's default, keeps none.

    Raises:
        InvalidArgumentError: a bad field (the message names it), at construction;
            ``store_policy`` is checked by the store it builds.
    """

    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    offload: str = "none"
    store_policy: str = "lru"
    enable_caching: bool = True
    hash_fn: str | HashFn = "sha256"
    hash_seed: int = 0
    evict_window: int = 64
    log_size: int | None = DEFAULT_LOG_SIZE
    watermark: float = 0.0

    def __post_init__(self) -> None:
        n_gpu = self.num_gpu_blocks
        if type(n_gpu) is not int or n_gpu < 2:
            raise InvalidArgumentError(
                f"num_gpu_blocks must be an int >= 2 (block 0 is the null block), got {checks.describe(n_gpu)}"
            )
        if type(self.block_size) is not int or self.block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {checks.describe(self.block_size)}")
        check_write_policy("offload", self.offload)
        n = self.num_cpu_blocks
        if type(n) is not int or n < 0 or n == 1:
            raise InvalidArgumentError(f"num_cpu_blocks must be 0 or an int >= 2, got {checks.describe(n)}")
        checks.flag("enable_caching", self.enable_caching)
        checks.count("evict_window", self.evict_window, 1)
        if self.log_size is not None:
            checks.count("log_size", self.log_size, 1)
        if self.offload != "none" and not self.enable_caching:
            raise InvalidArgumentError(f"offload={self.offload!r} keeps a CPU prefix tier, which needs prefix caching")
        if isinstance(self.hash_fn, str):
            get_hash_fn(self.hash_fn)
        elif not callable(self.hash_fn):
            raise InvalidArgumentError(
                f"hash_fn must be a hash function's name or a callable, got {checks.describe(self.hash_fn)}"
            )
        checks.count("hash_seed", self.hash_seed)
        w = self.watermark
        if (type(w) is not float and type(w) is not int) or not 0 <= w < 1:
            raise InvalidArgumentError(
                f"watermark must be a fraction of the pool in [0, 1) (vLLM's range), got {checks.describe(w)}"
            )
