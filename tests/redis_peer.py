"""One manager in its own process, against a real Redis server (driven by test_redis_store_server.py).

Usage: ``python redis_peer.py URL MODE SEED NUM_BLOCKS``, where MODE is

* ``store``: compute a prompt's block hashes, fill the CPU tier with KV for
  them (random, from SEED) and store the prefix on the server;
* ``load``: compute the same hashes, look the prefix up and load it;
* ``race``: like ``store``, but wait for the go signal (a Redis list) first, so
  that two peers store the same prefix at the same moment.

It prints one JSON line: the outcome of each block and the SHA-256 of each
block's bytes in its CPU tier (after the store, or after the load).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from tierutil import NS, block_bytes, host, plan

from tiered_kv.core import BlockHasher
from tiered_kv.core.request import Request
from tiered_kv.tiers.redis_io import RedisIO
from tiered_kv.tiers.redis_store import RedisStore, connect


def main() -> None:
    url, mode, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    bs = NS.spec.block_size
    request = Request("shared-prefix", list(range(1000, 1000 + n * bs)))
    keys = BlockHasher.create(bs, "sha256", seed=0).update(request)
    assert len(keys) == n
    st = host(num_blocks=n + 1, seed=seed)
    store = RedisStore(connect(url, timeout_s=2.0), NS)
    io = RedisIO(st, store, batch_blocks=4)
    slots = list(range(1, n + 1))
    if mode in ("store", "race"):
        if mode == "race":
            while not store.client.blpop(["go"], timeout=1):  # shorter than the socket timeout
                pass
        out = store.prepare_store(keys)
        h = io.submit(plan(1, "CPU", "REMOTE", slots, out.store_spec.block_ids))
    else:
        found = store.lookup_prefix(keys)
        assert found == n, f"found {found} of {n} blocks"
        spec = store.prepare_load(keys)
        h = io.submit(plan(2, "REMOTE", "CPU", spec.block_ids, slots))
    h.wait(60)
    io.close()
    digests = [hashlib.sha256(block_bytes(st, s)).hexdigest() for s in slots]
    print(json.dumps({"outcomes": [o.value for o in h.outcomes], "digests": digests, "pid": os.getpid()}))


if __name__ == "__main__":
    main()
