"""pytest-benchmark version of ``bench_hashing.py`` (collected only by ``pytest benchmarks``).

Run: ``.venv/bin/python -m pytest benchmarks/test_bench_hashing.py --benchmark-enable``.

Every group holds a bare floor over the same bytes, which is its fastest member,
so the factor pytest-benchmark prints in parentheses beside each time is the
ratio to that floor, measured in the same run: SHA-256 schemes against
``hashlib.sha256``, the non-cryptographic ones against ``xxh3_128_digest``.
Times are per pass over the whole trace, the driver's token appends included.
Without ``--benchmark-enable`` (the project's default options) each case runs
once, as a smoke test.
"""

from __future__ import annotations

import bench_hashing as bh
import pytest
from _trace import make_trace

from tiered_kv.core import BlockHasher

NUM_REQUESTS = 300
ROUNDS = 7
needs_xxhash = pytest.mark.skipif(bh.xxhash is None, reason="xxhash not installed")


@pytest.fixture(scope="module")
def trace():
    return make_trace(NUM_REQUESTS, seed=0)


@pytest.fixture(scope="module")
def reference(trace):
    """The SHA-256 chain of every request, and the exact bytes each block hashes."""
    work = bh.make_work(trace, "bulk")
    bh.hash_work(BlockHasher.create(bh.BLOCK_SIZE, "sha256"), work)
    hashes = [req.block_hashes for req, _ in work]
    return hashes, bh.floor_inputs(trace, hashes)


def group(scheme: str, mode: str, blocks: int) -> str:
    kind = "sha256" if scheme.startswith(("sha256", "hashlib")) else "non-cryptographic"
    return f"{kind} block hashing, {mode} mode ({blocks} blocks)"


@pytest.mark.parametrize("mode", bh.MODES)
@pytest.mark.parametrize("floor", [bh.SHA_FLOOR, pytest.param(bh.XXH_FLOOR, marks=needs_xxhash)])
def test_floor(benchmark, reference, floor, mode):
    # The floor does not depend on the mode; it is repeated so that each group has its anchor.
    hashes, inputs = reference
    benchmark.group = group(floor, mode, len(inputs))
    _, out = benchmark.pedantic(bh.time_floor, args=(floor, inputs), rounds=ROUNDS, warmup_rounds=1)
    if floor == bh.SHA_FLOOR:
        assert out == [h for hs in hashes for h in hs]
    else:
        assert len(out) == len(inputs)


@pytest.mark.parametrize("mode", bh.MODES)
@pytest.mark.parametrize("scheme", ["sha256 before", "sha256", "fast", pytest.param("xxh3_128", marks=needs_xxhash)])
def test_hasher(benchmark, trace, reference, scheme, mode):
    hashes, inputs = reference
    benchmark.group = group(scheme, mode, len(inputs))
    make = bh.hashers()[scheme]
    done = []

    def setup():
        hasher, work = make(), bh.make_work(trace, mode)
        done.append(work)
        return (hasher, work), {}

    benchmark.pedantic(bh.hash_work, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    got = [req.block_hashes for req, _ in done[-1]]
    assert sum(map(len, got)) == len(inputs)
    if scheme.startswith("sha256"):
        assert got == hashes
