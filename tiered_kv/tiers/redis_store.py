"""The remote tier: blocks in a Redis (or Valkey) server that several managers share.

**Keys.**  Every key carries the namespace prefix (:attr:`KVNamespace.redis_prefix`:
model, KV shape, dtype and hash scheme), so managers of incompatible KV never
see each other's blocks:

* ``<prefix>b:<name>``: the block, framed as on disk (header with namespace,
  key, length and CRC, then the payload);
* ``<prefix>c:<name>``: a short-lived *claim* while one manager writes the block.

**Publication.**  A block is one value written by one ``SET``, which Redis
applies atomically: a reader sees no value or the whole value, never part of
one, so a block is published only once all of its bytes are stored, and no read
is ever torn.  The CRC in the header is checked on every load anyway.

**No double store.**  A writer first takes the claim (``SET NX PX``) and checks
that the block is absent, in one round trip.  If the block exists it is
``PRESENT`` (nothing sent); if another manager holds the claim it is ``BUSY``
(nothing sent; that manager publishes it); otherwise it writes the block with
``SET NX`` and drops the claim.  A writer that dies loses only its claim,
which expires.

**This store's bookkeeping** is a local index of the keys this manager knows
about, with the CPU store's verbs and semantics: pending entries (its own
stores in flight), pinned entries (its own loads in flight) and known-ready
entries, bounded by ``index_blocks`` with a cache policy.  Evicting from the
index only forgets: the server's data is shared, and its size is bounded by
the server itself (``maxmemory`` with an eviction policy) and by the TTL.
:meth:`lookup` and :meth:`lookup_prefix` ask the server (one pipelined round
trip) and refresh the index: keys another manager stored are learned, keys
that expired are forgotten.  :meth:`remove` deletes from the server.
:meth:`touch` is local; the TTL is refreshed when a block is loaded.

A pin cannot stop the *server* from dropping a block (TTL, ``maxmemory``): a
load that finds its block gone reports it ``MISSING`` and fails cleanly.

**Faults.**  Each call to the server has a short socket timeout and goes
through a :class:`~tiered_kv.tiers.redis_health.RedisHealth` breaker: a server
that is down or slow makes lookups answer "miss" (counted) and never blocks
the scheduler for longer than one timeout per back-off period.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, MissingDependencyError
from tiered_kv.tiers.cpu_store import check_key, check_keys
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import KVNamespace, encodable, key_name
from tiered_kv.tiers.redis_health import HealthStats, RedisHealth
from tiered_kv.tiers.store import Key, LookupResult, StoreStats


def redis_module() -> Any:
    """The ``redis`` package, or a clear error naming the extra that installs it."""
    try:
        import redis
    except ImportError as exc:
        raise MissingDependencyError(
            f"the remote tier needs the redis package: pip install 'tiered-kv[redis]' ({exc})"
        ) from exc
    return redis


def connect(url: str, timeout_s: float = 0.5) -> Any:
    """A client for ``url`` (``redis://host:port/db``) that never waits long and never retries by itself.

    A retry inside the client would multiply the time the scheduler can be held;
    the store's breaker decides when to try again instead.
    """
    redis = redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


@dataclass(frozen=True, slots=True)
class RedisStoreStats:
    """The remote tier's own counters (the hit/query counters are :attr:`RedisStore.stats`).

    Attributes:
        learned: Keys found on the server that this manager had not stored or seen.
        stale: Indexed keys that the server no longer held (expired or deleted elsewhere).
        health: The breaker's counters (server errors, calls skipped in back-off).
    """

    learned: int
    stale: int
    health: HealthStats


class RedisStore(KeyedStore):
    """A :class:`~tiered_kv.tiers.cpu_store.CPUStore` over a shared Redis server.

    Args:
        client: A ``redis.Redis`` client (any object with its ``pipeline``,
            ``delete``), or a URL for :func:`connect`.
        namespace: What the stored KV is compatible with.
        index_blocks: Entries in the local index (``capacity``); make it larger
            than the longest prefix looked up at once.
        ttl_s: Seconds a block lives on the server after it is stored or last
            loaded; ``None`` for no expiry (the server's ``maxmemory`` policy decides).
        claim_ttl_s: How long a writer's claim lasts if the writer dies.
        health: The breaker shared with the I/O engine (a new one by default).
        policy, enable_events: As :class:`~tiered_kv.tiers.cpu_store.CPUStore`.
    """

    medium = "REMOTE"

    def __init__(
        self,
        client: Any,
        namespace: KVNamespace,
        index_blocks: int = 65536,
        ttl_s: float | None = None,
        claim_ttl_s: float = 10.0,
        health: RedisHealth | None = None,
        policy: str = "lru",
        enable_events: bool = False,
    ) -> None:
        checks.instance("namespace", namespace, KVNamespace)
        checks.count("index_blocks", index_blocks, 1)
        for name, value in (("ttl_s", ttl_s), ("claim_ttl_s", claim_ttl_s)):
            if value is None and name == "ttl_s":
                continue
            if value.__class__ not in (int, float) or not 0.001 <= value < float("inf"):  # type: ignore[operator]
                raise InvalidArgumentError(f"{name} must be a number of seconds >= 0.001, got {checks.describe(value)}")
        if health is not None:
            checks.instance("health", health, RedisHealth)
        if isinstance(client, str):
            client = connect(client)
        elif not callable(getattr(client, "pipeline", None)):
            raise InvalidArgumentError(
                f"client must be a redis client or a redis:// URL, got {checks.describe(client)}"
            )
        super().__init__(index_blocks + 1, policy=policy, enable_events=enable_events)
        self.client = client
        self.namespace = namespace
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.claim_ttl_ms = max(1, round(claim_ttl_s * 1000))
        self.health = health if health is not None else RedisHealth()
        self.server_errors: tuple[type[BaseException], ...] = (redis_module().RedisError, OSError)
        self._queries = self._hits = self._pending_hits = 0
        self._learned = self._stale = 0

    # ------------------------------------------------------------ names
    def data_key(self, key: Key) -> str:
        """The Redis key of ``key``'s block."""
        return f"{self.namespace.redis_prefix}b:{key_name(key)}"

    def claim_key(self, key: Key) -> str:
        """The Redis key of a writer's claim on ``key``."""
        return f"{self.namespace.redis_prefix}c:{key_name(key)}"

    # ------------------------------------------------------------ lookups
    def lookup(self, key: Key) -> LookupResult:
        check_key("key", key)
        self._queries += 1
        if self.contains(key) and not self.is_ready(key):
            self._pending_hits += 1
            return LookupResult.HIT_PENDING
        if encodable(key) and self._refresh([key])[0]:
            self._hits += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        keys = check_keys("keys", keys)
        self._queries += len(keys)
        leading = []
        for key in keys:  # a pending key ends the prefix without asking the server
            if not encodable(key) or (self.contains(key) and not self.is_ready(key)):
                break
            leading.append(key)
        n = 0
        for ready in self._refresh(leading):
            if not ready:
                break
            n += 1
        self._hits += n
        return n

    def probe(self, keys: Sequence[Key]) -> list[bool]:
        """Which of ``keys`` are loadable now, asking the server in one round trip (counted as queries).

        Unlike :meth:`lookup_prefix` it answers for every key, not only a
        leading run: a chain of tiers uses it to find the blocks that no tier
        above holds.  A server that is down answers all False.
        """
        keys = check_keys("keys", keys)
        ask = [k for k in keys if encodable(k) and not (self.contains(k) and not self.is_ready(k))]
        answer = dict(zip(ask, self._refresh(ask), strict=True))
        out = [answer.get(k, False) for k in keys]
        self._queries += len(keys)
        self._hits += sum(out)
        return out

    def _refresh(self, keys: list[Key]) -> list[bool]:
        """Ask the server which ``keys`` (ready or absent locally) exist; update the index; say which are ready now."""
        if not keys:
            return []
        if not self.health.available():
            return [False] * len(keys)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.data_key(key))
            exists = [bool(x) for x in pipe.execute()]
        except self.server_errors as exc:
            self.health.failure(exc)
            return [False] * len(keys)
        self.health.success()
        gone = [k for k, e in zip(keys, exists, strict=True) if not e and self.is_ready(k)]
        if gone:
            self._stale += len(gone)
            self.forget(gone)
        new = [k for k, e in zip(keys, exists, strict=True) if e and not self.contains(k)]
        if new:
            new = new[: max(0, self.room_for(keys))]  # protect every key asked about: they are one prefix
            out = KeyedStore.prepare_store(self, new)
            if out is not None:
                KeyedStore.complete_store(self, out.keys_to_store)
                self._learned += len(out.keys_to_store)
        return [e and self.is_ready(k) for k, e in zip(keys, exists, strict=True)]

    # ------------------------------------------------------------ server side of departures
    def _on_removed(self, keys: Sequence[Key]) -> None:
        if not self.health.available():
            return
        try:
            self.client.delete(*(self.data_key(k) for k in keys))
        except self.server_errors as exc:
            self.health.failure(exc)
        else:
            self.health.success()

    # Evictions and forgotten keys only leave the local index: the server's copy is shared.
    # A failed store published nothing (the value is one atomic SET), so there is nothing to undo.

    # ------------------------------------------------------------ gauges
    @property
    def stats(self) -> StoreStats:
        return StoreStats(self._queries, self._hits, self._pending_hits, super().stats.evictions)

    @property
    def remote_stats(self) -> RedisStoreStats:
        return RedisStoreStats(self._learned, self._stale, self.health.stats)
