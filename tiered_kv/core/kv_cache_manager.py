"""KVCacheManager: per-request block tables over one BlockPool (vLLM v1's role).

The scheduler calls, per request and step:

1. ``get_computed_blocks(request)`` once, on admission: the longest cached
   prefix, capped so the last prompt token is always recomputed (its logits are
   needed to sample).  It does not touch: a lookup is not yet a commitment.
2. ``allocate_slots(request, num_new_tokens, ...)``: all-or-nothing.  Returns the
   newly allocated blocks, or ``None`` with nothing changed when they do not fit.
   Every block that becomes full of *final* tokens is cached right away, at
   scheduling time (safe because forward passes run in order).  Lookahead
   (speculative) slots get blocks but are never cached.  An admission (the
   first allocation of a request that holds no blocks: a waiting or preempted
   one) may also be gated as vLLM 0.33 gates it: ``full_sequence_must_fit``
   (its whole sequence must fit, not only the first chunk) and the watermark
   (blocks kept free while other requests are running).
3. ``free(request)``: releases the table last block first.

Block tables are append-only: an id, once in a table, is never replaced.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

from tiered_kv import checks
from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.block_hasher import BlockHasher
from tiered_kv.core.block_pool import BlockPool
from tiered_kv.core.compile_hints import mypyc_attr
from tiered_kv.core.events import BlockStored, KVCacheEvent
from tiered_kv.core.hashing import HashFn
from tiered_kv.core.request import Request
from tiered_kv.core.stats import PrefixCacheStats
from tiered_kv.errors import InvalidArgumentError

FULL_ATTENTION = "full_attention"
"""vLLM's ``KVCacheSpecKind.FULL_ATTENTION.value``: the kind of tiered_kv's one KV cache group."""


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheManager:
    """Block tables for requests over one pool.

    Args:
        num_blocks: Size of a new pool (ignored when ``block_pool`` is given).
        block_size: Tokens per block (> 0).
        enable_caching: Prefix caching.
        hash_fn: ``"sha256"``, ``"fast"`` or a callable (see :mod:`.hashing`).
        hash_seed: Seed of the root hash.
        enable_kv_cache_events: Queue the pool's events (see :mod:`.events`).
        kv_events_int_hashes: Events publish hashes as 64-bit ints (vLLM's default) or as held.
        block_pool: An existing pool to manage (the tier manager shares pools).
        log_stats: Count prefix-cache statistics.
        max_model_len: Cap on slots per request (``None``: no cap).
        watermark: vLLM 0.33's KV-cache watermark, a fraction in ``[0, 1)`` of
            the pool (null block included, as vLLM counts ``num_blocks``):
            ``int(watermark * num_blocks)`` blocks an admission must leave free
            when other requests are running (see :meth:`allocate_slots`).
            ``0.0``, vLLM's default, keeps none.
    """

    def __init__(
        self,
        num_blocks: object = None,
        block_size: object = 16,
        *,
        enable_caching: object = True,
        hash_fn: str | HashFn = "sha256",
        hash_seed: object = 0,
        enable_kv_cache_events: object = False,
        kv_events_int_hashes: object = True,
        block_pool: object = None,
        medium: object = "GPU",
        log_stats: object = True,
        max_model_len: object = None,
        watermark: object = 0.0,
    ) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        seed = checks.count("hash_seed", hash_seed)
        if type(log_stats) is not bool:
            raise InvalidArgumentError(f"log_stats must be True or False, got {checks.describe(log_stats)}")
        if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 1):
            raise InvalidArgumentError(f"max_model_len must be an int > 0, got {checks.describe(max_model_len)}")
        if (type(watermark) is not float and type(watermark) is not int) or not 0 <= watermark < 1:
            raise InvalidArgumentError(
                f"watermark must be a fraction of the pool in [0, 1) (vLLM's range), got {checks.describe(watermark)}"
            )
        if block_pool is None:
            if num_blocks is None:
                raise InvalidArgumentError("give num_blocks or block_pool")
            block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events, medium, kv_events_int_hashes)
        elif not isinstance(block_pool, BlockPool):
            raise InvalidArgumentError(f"block_pool must be a BlockPool, got {checks.describe(block_pool)}")
        self.block_pool: BlockPool = block_pool
        self.block_size: int = block_size
        self.enable_caching: bool = block_pool.enable_caching
        self.hasher: BlockHasher = BlockHasher.create(block_size, hash_fn, seed)
        self.log_stats: bool = log_stats
        self.prefix_cache_stats = PrefixCacheStats()
        self.max_model_len: int | None = max_model_len
        #: Blocks an admission leaves free while others run: vLLM's ``int(watermark * num_blocks)``.
        self.watermark_blocks: int = int(watermark * block_pool.num_blocks)
        self.req_to_blocks: dict[Hashable, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, request: object) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request`` (a :class:`Request`): (blocks, tokens).  Does not touch."""
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        hashes = self.hasher.update(request)
        # Cap: the last prompt token must be recomputed to produce logits (an empty prompt: nothing to find).
        max_blocks = max(len(request.all_token_ids) - 1, 0) // self.block_size
        computed = self.block_pool.get_cached_prefix(hashes, max_blocks)
        num_tokens = len(computed) * self.block_size
        if self.log_stats:
            self.prefix_cache_stats.record(request.num_tokens, num_tokens, request.num_preemptions > 0)
        return computed, num_tokens

    # -------------------------------------------------------------- allocation
    def num_blocks_to_allocate(
        self,
        request: object,
        num_new_tokens: object,
        num_new_computed_tokens: object = 0,
        new_computed_blocks: object = None,
        num_lookahead_tokens: object = 0,
    ) -> int:
        """Free blocks ``allocate_slots`` would consume (new blocks plus evictable hits)."""
        req, n_tok, n_comp, computed, n_ahead, _ = self._check_allocation(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens, False
        )
        n_new, n_evictable = self._blocks_needed(
            req, self.req_to_blocks.get(req.request_id), n_comp + n_tok + n_ahead, computed or []
        )
        return n_new + n_evictable

    def num_free_blocks_required(
        self,
        request: object,
        num_new_tokens: object,
        num_new_computed_tokens: object = 0,
        new_computed_blocks: object = None,
        num_lookahead_tokens: object = 0,
        *,
        full_sequence_must_fit: object = False,
        has_scheduled_reqs: object = True,
    ) -> int:
        """Free blocks the pool must have for ``allocate_slots`` with these arguments to fit.

        ``allocate_slots`` returns ``None`` exactly when this exceeds
        ``block_pool.get_num_free_blocks()``: what it takes (new blocks plus
        evictable hits), or with ``full_sequence_must_fit`` what the whole
        sequence would take if that is more, plus the watermark where it
        applies.  Nothing changes.
        """
        req, n_tok, n_comp, computed, n_ahead, _ = self._check_allocation(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens, False
        )
        full = checks.flag("full_sequence_must_fit", full_sequence_must_fit)
        scheduled = checks.flag("has_scheduled_reqs", has_scheduled_reqs)
        hits = computed or []
        req_blocks = self.req_to_blocks.get(req.request_id)
        n_new, n_evictable = self._blocks_needed(req, req_blocks, n_comp + n_tok + n_ahead, hits)
        return self._required(req, req_blocks, hits, n_new + n_evictable, n_evictable, full, scheduled)

    def _required(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock] | None,
        hits: list[KVCacheBlock],
        need: int,
        n_evictable: int,
        full: bool,
        has_scheduled_reqs: bool,
    ) -> int:
        """Free blocks an allocation taking ``need`` must find: vLLM 0.33's two admission checks as one count.

        vLLM refuses when the whole sequence (``full``: ``min(num_tokens,
        max_model_len)`` tokens, its hits counted as held) plus the watermark
        exceeds the free blocks, or when the allocation itself plus the
        watermark does; refusing when the larger of the two does is the same.
        The watermark applies to an admission (a request holding no blocks: a
        waiting or preempted one) while other requests run (``has_scheduled_reqs``),
        never to a running request's growth.
        """
        if full:
            total = len(request.all_token_ids)
            if self.max_model_len is not None:
                total = min(total, self.max_model_len)
            n_have = (len(req_blocks) if req_blocks is not None else 0) + len(hits)
            whole = max(-(-total // self.block_size) - n_have, 0) + n_evictable
            if whole > need:
                need = whole
        if req_blocks is None and has_scheduled_reqs:
            need += self.watermark_blocks
        return need

    def _blocks_needed(
        self, request: Request, req_blocks: list[KVCacheBlock] | None, num_tokens: int, hits: list[KVCacheBlock]
    ) -> tuple[int, int]:
        """(new blocks, evictable prefix hits) that ``num_tokens`` more tokens after ``hits`` take from the pool."""
        total = request.num_computed_tokens + num_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        n_have = (len(req_blocks) if req_blocks is not None else 0) + len(hits)
        n_new = max(-(-total // self.block_size) - n_have, 0)
        return n_new, sum(1 for b in hits if b.ref_cnt == 0)

    # Like vLLM's allocate_slots it checks every argument before it changes anything, then
    # touches hits, hands out blocks and caches, in that order: the all-or-nothing checks sit
    # beside the changes they guard.  It is the hottest call of every step.
    def allocate_slots(
        self,
        request: object,
        num_new_tokens: object,
        num_new_computed_tokens: object = 0,
        new_computed_blocks: object = None,
        num_lookahead_tokens: object = 0,
        delay_cache_blocks: object = False,
        *,
        num_external_computed_tokens: object = 0,
        full_sequence_must_fit: object = False,
        has_scheduled_reqs: object = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) more tokens of ``request``.

        Args:
            request: The :class:`Request`; ``request.num_computed_tokens`` is its progress.
            num_new_tokens: Tokens to compute this step (an int > 0).
            num_new_computed_tokens: Tokens covered by ``new_computed_blocks`` (an int >= 0).
            new_computed_blocks: Prefix hits from ``get_computed_blocks`` (a list;
                first allocation only); touched here, once the allocation is known to fit.
            num_lookahead_tokens: Speculative slots (an int >= 0): allocated, never cached.
            delay_cache_blocks: Skip caching this step (e.g. KV still arriving).
            num_external_computed_tokens: Tokens after the prefix hits whose KV
                another tier will copy into the new blocks (an int >= 0; first
                allocation only; included in ``num_new_tokens``, as in vLLM).
                Their blocks are not written yet, so nothing is cached by this
                call; call :meth:`cache_blocks` once the copy has landed.
            full_sequence_must_fit: vLLM 0.33's admission gate
                (``scheduler_reserve_full_isl``): allocate only if the pool
                could also hold the request's whole sequence (all its tokens,
                its hits counted as held), not only this chunk.
            has_scheduled_reqs: Whether other requests are running; only then
                does an admission (a request holding no blocks) have to leave
                :attr:`watermark_blocks` free, as in vLLM.

        Returns:
            The newly allocated blocks (possibly empty), or ``None`` when they do
            not fit; then nothing at all has changed.
        """
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
        rid = request.request_id
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(rid)
        if (
            new_computed_blocks is None
            and req_blocks is not None
            and type(num_new_tokens) is int
            and num_new_tokens > 0
            and type(num_lookahead_tokens) is int
            and num_lookahead_tokens == 0
            and type(num_new_computed_tokens) is int
            and num_new_computed_tokens == 0
            and type(num_external_computed_tokens) is int
            and num_external_computed_tokens == 0
            and type(delay_cache_blocks) is bool
            and self.max_model_len is None
            and full_sequence_must_fit is False
            and type(has_scheduled_reqs) is bool
        ):
            # Fast path, the common decode/chunked-prefill step of a running request (no watermark: it holds blocks).
            total = request.num_computed_tokens + num_new_tokens
            n_new = -(-total // bs) - len(req_blocks)
            if n_new > 0:
                pool = self.block_pool
                if n_new > pool.free_block_queue.num_free_blocks:
                    return None
                new_blocks = pool.get_new_blocks(n_new)
                req_blocks.extend(new_blocks)
            else:
                new_blocks = []
            if self.enable_caching and not delay_cache_blocks:
                # cache_blocks, inlined: its arguments are known good here (a step filling a block).
                n_tok = len(request.all_token_ids)
                num_full = (total if total < n_tok else n_tok) // bs
                n_cached = self.num_cached_block[rid]
                if num_full > n_cached:
                    if len(request.block_hashes) < num_full:
                        self.hasher.update(request)
                    self.block_pool.cache_full_blocks(request, req_blocks, n_cached, num_full, bs)
                    self.num_cached_block[rid] = num_full
            return new_blocks

        return self._allocate_general(
            request,
            req_blocks,
            self._check_allocation(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                delay_cache_blocks,
            ),
            checks.count("num_external_computed_tokens", num_external_computed_tokens),
            checks.flag("full_sequence_must_fit", full_sequence_must_fit),
            checks.flag("has_scheduled_reqs", has_scheduled_reqs),
        )

    def num_quiet_tokens(self, request_id: Hashable, delay_cache_blocks: object = False) -> int:
        """The most tokens a request can reach through ``allocate_slots`` with nothing changing.

        For every later call ``allocate_slots(request, n)`` (no prefix hits, no
        lookahead, no external tokens, ``delay_cache_blocks`` as given here)
        with ``request.num_computed_tokens + n`` at most this value, the call
        allocates no block, caches no block and returns ``[]``: the pool and
        the table stay exactly as they are.  A scheduler may skip such a call
        (a decode token that lands in a block the request already holds and
        does not fill it), which is most decode steps.

        The value stays valid while the request's table only grows and its
        cached count only rises, i.e. until it is freed; ``0`` for a request
        with no table, or with ``max_model_len`` set (its cap is applied per
        call, so no call is skipped).
        """
        checks.hashable("request_id", request_id)
        delay = checks.flag("delay_cache_blocks", delay_cache_blocks)
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or self.max_model_len is not None:
            return 0
        bs = self.block_size
        room = len(blocks) * bs
        if self.enable_caching and not delay:
            # One token short of filling the next uncached block: filling it caches it.
            unfilled = (self.num_cached_block[request_id] + 1) * bs - 1
            if unfilled < room:
                return unfilled
        return room

    def _allocate_general(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock] | None,
        args: tuple[Request, int, int, list[KVCacheBlock] | None, int, bool],
        n_ext: int,
        full: bool,
        has_scheduled_reqs: bool,
    ) -> list[KVCacheBlock] | None:
        """``allocate_slots`` for every case but a running request's plain step, arguments checked."""
        _, n_tokens, n_comp, hits, n_ahead, delay = args
        rid = request.request_id
        bs = self.block_size
        if n_ext:
            if req_blocks:
                raise InvalidArgumentError(f"request {rid!r}: external KV can only arrive with the first allocation")
            if n_ext > n_tokens:
                raise InvalidArgumentError(
                    f"request {rid!r}: num_external_computed_tokens {n_ext} exceeds "
                    f"num_new_tokens {n_tokens}, which includes them"
                )
            delay = True  # their blocks are written by a copy that has not landed
        computed = hits if hits is not None else []
        if computed:
            if req_blocks:
                raise InvalidArgumentError(f"request {rid!r}: prefix hits can only be added on first allocation")
            if n_comp != len(computed) * bs:
                raise InvalidArgumentError(
                    f"request {rid!r}: {len(computed)} computed blocks cover {len(computed) * bs} tokens, "
                    f"not num_new_computed_tokens={n_comp}"
                )
            self._check_prefix_hits(request, "new_computed_blocks", computed)
        num_computed = request.num_computed_tokens + n_comp
        n_new, n_evictable = self._blocks_needed(request, req_blocks, n_comp + n_tokens + n_ahead, computed)
        pool = self.block_pool
        need = self._required(request, req_blocks, computed, n_new + n_evictable, n_evictable, full, has_scheduled_reqs)
        if need > pool.free_block_queue.num_free_blocks:
            return None

        if computed:
            pool.touch(computed)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = list(computed)
            self.num_cached_block[rid] = len(computed)
        new_blocks = pool.get_new_blocks(n_new) if n_new else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if self.enable_caching and not delay:
            n_cache = num_computed + n_tokens
            if n_cache > len(request.all_token_ids):
                n_cache = len(request.all_token_ids)  # never cache lookahead/draft slots
            self.cache_blocks(request, n_cache)
        return new_blocks

    def _check_allocation(
        self,
        request: object,
        num_new_tokens: object,
        num_new_computed_tokens: object,
        new_computed_blocks: object,
        num_lookahead_tokens: object,
        delay_cache_blocks: object,
    ) -> tuple[Request, int, int, list[KVCacheBlock] | None, int, bool]:
        """Every argument of an allocation, checked before anything is touched or installed; returned typed."""
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
        n_tokens = checks.count("num_new_tokens", num_new_tokens, 1)
        n_comp = checks.count("num_new_computed_tokens", num_new_computed_tokens)
        n_ahead = checks.count("num_lookahead_tokens", num_lookahead_tokens)
        delay = checks.flag("delay_cache_blocks", delay_cache_blocks)
        hits: list[KVCacheBlock] | None = None
        if new_computed_blocks is not None:
            if type(new_computed_blocks) is not list:
                raise InvalidArgumentError(
                    f"new_computed_blocks must be a list of blocks or None, got {checks.describe(new_computed_blocks)}"
                )
            hits = self.block_pool.check_own_blocks("new_computed_blocks", new_computed_blocks)
        return request, n_tokens, n_comp, hits, n_ahead, delay

    def _check_prefix_hits(self, request: Request, name: str, hits: list[KVCacheBlock]) -> None:
        """Raise unless ``hits[i]`` is cached under the request's own ``i``-th block hash, for every ``i``.

        A hit maps the request's positions onto the hit's KV: a block cached
        under another hash (another prefix, or the same hit given twice) would
        make the request attend to KV that is not its own.  Checked before any
        change; hashing the request's full blocks here changes no pool state.
        """
        rid = request.request_id
        if not self.enable_caching:
            raise InvalidArgumentError(f"request {rid!r}: {name} given with prefix caching off (nothing is cached)")
        hashes = request.block_hashes
        if len(hashes) < len(hits):
            hashes = self.hasher.update(request)
        if len(hits) > len(hashes):
            raise InvalidArgumentError(
                f"request {rid!r}: {len(hits)} {name} but the request has only {len(hashes)} full blocks"
            )
        for i, b in enumerate(hits):
            if b.block_hash is None or b.block_hash != hashes[i]:
                raise InvalidArgumentError(
                    f"request {rid!r}: {name}[{i}] (block {b.block_id}) is not cached under the request's "
                    f"block {i} hash: hits must be the request's own cached prefix, in order"
                )

    def cache_blocks(self, request: object, num_computed_tokens: object) -> None:
        """Cache every full block of ``request`` within its first ``num_computed_tokens`` tokens.

        A no-op with prefix caching off: nothing is hashed or cached then.
        """
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
        n_tokens = checks.count("num_computed_tokens", num_computed_tokens)
        if n_tokens > len(request.all_token_ids):
            raise InvalidArgumentError(
                f"request {request.request_id!r}: cannot cache {n_tokens} tokens of {request.num_tokens}"
            )
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = n_tokens // self.block_size
        n_cached = self.num_cached_block.get(rid, 0)
        if num_full <= n_cached:
            return
        if len(request.block_hashes) < num_full:
            self.hasher.update(request)
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], n_cached, num_full, self.block_size)
        self.num_cached_block[rid] = num_full

    def restore(self, request: object, computed_blocks: object, num_tokens: object) -> list[KVCacheBlock] | None:
        """Give a request that holds no blocks a table for ``num_tokens`` tokens of KV it already has elsewhere.

        A swapped-out request coming back: ``computed_blocks`` are the prefix
        hits still cached in this pool (touched here), and new blocks cover
        the rest, to be filled by a copy from another tier.  Nothing new is
        cached until that copy lands and the caller calls :meth:`cache_blocks`.
        The request's ``num_computed_tokens`` is the scheduler's and is neither
        read nor changed.  All-or-nothing: ``None`` (and no change) when the
        blocks do not fit.

        Returns:
            The new blocks, in table order after the hits.
        """
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
        if type(computed_blocks) is not list:
            raise InvalidArgumentError(
                f"computed_blocks must be a list of blocks, got {checks.describe(computed_blocks)}"
            )
        hits = self.block_pool.check_own_blocks("computed_blocks", computed_blocks)
        n_tokens = checks.count("num_tokens", num_tokens, 1)
        rid = request.request_id
        bs = self.block_size
        if self.req_to_blocks.get(rid):
            raise InvalidArgumentError(f"request {rid!r} already holds blocks; restore only a request that holds none")
        if len(hits) * bs > n_tokens or n_tokens > len(request.all_token_ids):
            raise InvalidArgumentError(
                f"request {rid!r}: {len(hits)} cached blocks and {n_tokens} tokens do not fit "
                f"a request of {request.num_tokens} tokens"
            )
        if hits:
            self._check_prefix_hits(request, "computed_blocks", hits)
        n_new = -(-n_tokens // bs) - len(hits)
        pool = self.block_pool
        if n_new + sum(1 for b in hits if b.ref_cnt == 0) > pool.free_block_queue.num_free_blocks:
            return None
        pool.touch(hits)
        new_blocks = pool.get_new_blocks(n_new) if n_new else []
        self.req_to_blocks[rid] = [*hits, *new_blocks]
        self.num_cached_block[rid] = len(hits)
        return new_blocks

    def free(self, request: object) -> None:
        """Release the request's blocks, last block first.

        A request with no blocks (never allocated, or already freed) is a no-op,
        as in vLLM: schedulers free waiting requests that never got memory.
        """
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    # ------------------------------------------------------------- inspection
    def get_blocks(self, request_id: Hashable) -> list[KVCacheBlock]:
        """The request's block table (the live list: do not mutate)."""
        checks.hashable("request_id", request_id)
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: Hashable) -> list[int]:
        checks.hashable("request_id", request_id)
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the counters since the last call and start new ones (``None`` if not logging)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok and self.log_stats:
            self.prefix_cache_stats.reset = True
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's events since the last call, each ``BlockStored`` labelled with its KV cache kind.

        As vLLM 0.33's ``KVCacheManager.take_events`` does: the pool emits structure only, and
        the manager, which knows its one group is full attention, names the kind
        (``"full_attention"``, no sliding window) so that a consumer can classify the blocks.
        """
        events = self.block_pool.take_events()
        for i, ev in enumerate(events):
            if isinstance(ev, BlockStored) and ev.group_idx == 0:
                events[i] = replace(ev, kv_cache_spec_kind=FULL_ATTENTION)
        return events
