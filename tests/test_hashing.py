"""Chained block hashes: what they cover, the byte layout, determinism, and incrementality."""

import hashlib
import random
import subprocess
import sys

import pytest

from tiered_kv.core import BlockHasher, KVCacheManager, MultiModalFeature, Request, sha256_block_hash
from tiered_kv.core.hashing import (
    HASH_FUNCTIONS,
    OPTIONAL_HASH_FUNCTIONS,
    fast_block_hash,
    get_hash_fn,
    root_hash,
    xxh3_128_block_hash,
)
from tiered_kv.errors import HashingError, InvalidArgumentError

try:
    import xxhash
except ImportError:
    xxhash = None

needs_xxhash = pytest.mark.skipif(xxhash is None, reason="xxhash not installed (pip install 'tiered-kv[xxhash]')")
ALL_FNS = [*sorted(HASH_FUNCTIONS), pytest.param("xxh3_128", marks=needs_xxhash)]
DIGEST_FNS = ["sha256", pytest.param("xxh3_128", marks=needs_xxhash)]


@pytest.mark.parametrize("fn", ALL_FNS)
def test_chain_covers_parent_tokens_and_extra_keys(fn):
    h = BlockHasher.create(4, fn)
    base = h.update(Request("a", [1, 2, 3, 4, 5, 6, 7, 8]))
    assert len(base) == 2 and base[0] != base[1]
    assert h.update(Request("b", [1, 2, 3, 4, 5, 6, 7, 8])) == base
    # Same second block, different first block: the chain makes the second hash differ.
    other = h.update(Request("c", [9, 2, 3, 4, 5, 6, 7, 8]))
    assert other[1] != base[1]
    assert h.update(Request("d", [1, 2, 3, 4, 5, 6, 7, 8], lora_name="L"))[0] != base[0]
    salted = h.update(Request("e", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="tenant"))
    assert salted[0] != base[0] and salted[1] != base[1]  # salt on block 0, carried by the chain
    img = MultiModalFeature("img-1", offset=5, length=2)
    mm = h.update(Request("f", [1, 2, 3, 4, 5, 6, 7, 8], mm_features=[img]))
    assert mm[0] == base[0] and mm[1] != base[1]  # only the overlapped block changes
    moved = h.update(Request("g", [1, 2, 3, 4, 5, 6, 7, 8], mm_features=[MultiModalFeature("img-1", 4, 2)]))
    assert moved[1] != mm[1]  # the offset is part of the key


def test_seeded_root_changes_every_hash():
    a = BlockHasher.create(2, "sha256", seed=0).update(Request("a", [1, 2]))
    b = BlockHasher.create(2, "sha256", seed=1).update(Request("a", [1, 2]))
    assert a != b
    assert root_hash(HASH_FUNCTIONS["fast"], 0) != root_hash(HASH_FUNCTIONS["fast"], 1)


def test_hashing_is_incremental():
    calls = []

    def counting(parent, tokens, extra):
        calls.append(tuple(tokens))
        return hash((parent, *tokens))

    h = BlockHasher.create(2, counting)
    calls.clear()
    r = Request("r", [1, 2, 3])
    h.update(r)
    assert calls == [(1, 2)]
    h.update(r)
    assert calls == [(1, 2)]
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    h.update(r)
    assert calls == [(1, 2), (3, 4), (5, 6)]
    assert h.num_hashed_blocks == 3


@pytest.mark.parametrize("fn", ALL_FNS)
def test_hashes_are_identical_across_processes(fn):
    code = (
        "from tiered_kv.core import BlockHasher, Request;"
        f"print(BlockHasher.create(2, {fn!r}).update(Request('x', [1, 2, 3, 4], lora_name='L', cache_salt='s')))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and outs.pop().startswith("[")


def test_partial_block_and_bad_names_are_refused():
    h = BlockHasher.create(4)
    with pytest.raises(HashingError, match="partial block: 3 tokens, block size 4"):
        h.hash_block(None, [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match=r"unknown hash function 'md5'.*'xxh3_128'"):
        BlockHasher.create(4, "md5")
    with pytest.raises(InvalidArgumentError, match="block_size"):
        BlockHasher.create(0)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        BlockHasher.create(True)
    with pytest.raises(InvalidArgumentError, match="hash_fn must be"):
        BlockHasher.create(4, 42)


# ---------------------------------------------------------------- the byte layout, independently
def ref_tagged(obj) -> bytes:
    """The tagged encoding, written out from its description rather than taken from the code."""
    if obj is None:
        return b"N"
    if obj is True or obj is False:
        return b"T" if obj else b"F"
    if isinstance(obj, int):
        n = 1
        while not -(1 << (8 * n - 1)) <= obj < 1 << (8 * n - 1):
            n += 1
        return b"I" + n.to_bytes(2, "little") + obj.to_bytes(n, "little", signed=True)
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return b"S" + len(raw).to_bytes(4, "little") + raw
    if isinstance(obj, bytes):
        return b"B" + len(obj).to_bytes(4, "little") + obj
    assert isinstance(obj, tuple | list)
    return b"L" + len(obj).to_bytes(4, "little") + b"".join(ref_tagged(x) for x in obj)


def ref_layout(parent, tokens, extra, digest_size: int) -> bytes:
    """``parent || uint32 n || n x int64 LE [|| "X" || tagged keys]``, the parent raw only as a digest."""
    head = parent if isinstance(parent, bytes) and len(parent) == digest_size else ref_tagged(parent)
    data = head + len(tokens).to_bytes(4, "little") + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return data if extra is None else data + b"X" + ref_tagged(extra)


def ref_digest(fn: str):
    if fn == "sha256":
        return lambda parent, tokens, extra: hashlib.sha256(ref_layout(parent, tokens, extra, 32)).digest()
    return lambda parent, tokens, extra: xxhash.xxh3_128_digest(ref_layout(parent, tokens, extra, 16))


def ref_extra_keys(request_kwargs: dict, start: int, end: int):
    """LoRA on every block, overlapping multimodal inputs as ``(id, offset)``, the salt on block 0."""
    lora, salt = request_kwargs.get("lora_name"), request_kwargs.get("cache_salt")
    keys = [] if lora is None else [lora]
    for mm in request_kwargs.get("mm_features", ()):
        if mm.offset < end and mm.offset + mm.length > start:
            keys.append((mm.identifier, mm.offset))
    if start == 0 and salt is not None:
        keys.append(("salt", salt))
    return tuple(keys) or None


def random_request(rng: random.Random, bs: int) -> tuple[list[int], dict]:
    n = rng.randrange(1, 12 * bs + 2)
    pick = [lambda: rng.randrange(0, 32000), lambda: rng.randrange(-(1 << 63), 1 << 63), lambda: rng.randrange(-3, 3)]
    tokens = [rng.choice(pick)() for _ in range(n)]
    kw: dict = {}
    if rng.random() < 0.3:
        kw["lora_name"] = rng.choice(["adapter", "lora-β", ""])
    if rng.random() < 0.3:
        kw["cache_salt"] = rng.choice(["tenant-1", "t2", ""])
    if rng.random() < 0.3:
        kw["mm_features"] = [
            MultiModalFeature(f"img-{j}", rng.randrange(n), rng.randrange(1, 3 * bs))
            for j in range(rng.randrange(1, 4))
        ]
    return tokens, kw


def grow_and_hash(hasher: BlockHasher, rng: random.Random, tokens: list[int], kw: dict) -> list:
    """Hash ``tokens`` the way a serving loop would: a prompt, then appends in random chunks."""
    cut = rng.randrange(1, len(tokens) + 1)
    req = Request("r", tokens[:cut], **kw)
    hasher.update(req)
    rest = tokens[cut:]
    while rest:
        k = rng.randrange(1, 2 * hasher.block_size + 1)
        req.append_output_token_ids(rest[:k])
        rest = rest[k:]
        if rng.random() < 0.7:
            hasher.update(req)
    return hasher.update(req)


@pytest.mark.parametrize("fn", DIGEST_FNS)
def test_hasher_matches_the_documented_layout_on_random_requests(fn):
    rng = random.Random(20261130)
    ref = ref_digest(fn)
    for case in range(300):
        bs = rng.choice([1, 2, 3, 5, 16, 32])
        seed = rng.randrange(-(1 << 70), 1 << 70)
        tokens, kw = random_request(rng, bs)
        got = grow_and_hash(BlockHasher.create(bs, fn, seed), rng, tokens, kw)
        parent = ref(0, (), ("tiered_kv-root", seed))
        want = []
        for i in range(len(tokens) // bs):
            extra = ref_extra_keys(kw, i * bs, i * bs + bs)
            parent = ref(parent, tokens[i * bs : (i + 1) * bs], extra)
            want.append(parent)
        assert got == want, f"case {case}: block size {bs}, {kw}"


def random_key(rng: random.Random, depth: int = 0):
    kinds = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randrange(-(1 << 80), 1 << 80),
        lambda: "".join(rng.choice("aβ-0") for _ in range(rng.randrange(6))),
        lambda: rng.randbytes(rng.randrange(40)),
    ]
    if depth < 2:
        kinds.append(lambda: tuple(random_key(rng, depth + 1) for _ in range(rng.randrange(3))))
        kinds.append(lambda: [random_key(rng, depth + 1) for _ in range(rng.randrange(3))])
    return rng.choice(kinds)()


@pytest.mark.parametrize("fn", DIGEST_FNS)
def test_block_function_matches_the_layout_for_any_parent_and_keys(fn):
    rng = random.Random(7)
    block_fn = get_hash_fn(fn)
    ref = ref_digest(fn)
    size = 32 if fn == "sha256" else 16
    for _ in range(300):
        parent = rng.choice(
            [rng.randbytes(size), 0, rng.randrange(1 << 70), "p", None, (1, "x"), rng.randbytes(size + 1), b""]
        )
        tokens = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(rng.randrange(0, 40))]
        extra = None if rng.random() < 0.3 else tuple(random_key(rng) for _ in range(rng.randrange(4)))
        assert block_fn(parent, tokens, extra) == ref(parent, tokens, extra)


def golden_requests():
    """Seeded requests whose SHA-256 block hashes are pinned below."""
    rng = random.Random(99)
    for i in range(60):
        bs = rng.choice([4, 16])
        tokens, kw = random_request(rng, bs)
        yield bs, i, tokens, kw


def test_sha256_digests_are_unchanged_from_the_per_block_implementation():
    # Pinned from the implementation that hashed block by block, before tokens were
    # packed once per call: the new path must give the very same bytes.
    rng = random.Random(5)
    everything = hashlib.sha256()
    for bs, seed, tokens, kw in golden_requests():
        for h in grow_and_hash(BlockHasher.create(bs, "sha256", seed), rng, tokens, kw):
            everything.update(h)
    assert everything.hexdigest() == GOLDEN


GOLDEN = "b23895cb53bec635560265270235266fec4518434d5507ddb172b99fc4452518"  # 321 blocks


def test_fast_hasher_matches_the_block_function():
    rng = random.Random(3)
    for _ in range(200):
        bs = rng.choice([1, 4, 16])
        seed = rng.randrange(1 << 40)
        tokens, kw = random_request(rng, bs)
        got = grow_and_hash(BlockHasher.create(bs, "fast", seed), rng, tokens, kw)
        parent = root_hash(fast_block_hash, seed)
        want = []
        for i in range(len(tokens) // bs):
            extra = ref_extra_keys(kw, i * bs, i * bs + bs)
            parent = fast_block_hash(parent, tokens[i * bs : (i + 1) * bs], extra)
            want.append(parent)
        assert got == want


@pytest.mark.parametrize("fn", ALL_FNS)
def test_tokens_taken_back_past_the_last_full_block_never_leak_into_hashes(fn):
    # Callers may retract unscheduled samples; only full blocks are ever read.
    h = BlockHasher.create(4, fn)
    r = Request("r", [1, 2, 3, 4, 5, 6])
    h.update(r)
    r.append_output_token_ids([7])
    del r.all_token_ids[-3:]  # back to [1, 2, 3, 4]
    r.append_output_token_ids([50, 60, 70, 80, 90])
    h.update(r)
    fresh = BlockHasher.create(4, fn).update(Request("s", [1, 2, 3, 4, 50, 60, 70, 80, 90]))
    assert r.block_hashes == fresh and len(fresh) == 2


@pytest.mark.parametrize("fn", DIGEST_FNS)
@pytest.mark.parametrize("n_new", [1, 3])  # the one-block path and the packed-run path
def test_an_unhashable_token_changes_nothing(fn, n_new):
    h = BlockHasher.create(2, fn)
    r = Request("r", [1, 2, 3])
    h.update(r)
    r.append_output_token_ids([4] * (2 * n_new - 2) + [1 << 63, 5])
    before = (list(r.block_hashes), h.num_hashed_blocks)
    with pytest.raises(HashingError, match="int64 range"):
        h.update(r)
    assert (list(r.block_hashes), h.num_hashed_blocks) == before


def test_xxh3_128_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)  # an import of xxhash now fails
    assert OPTIONAL_HASH_FUNCTIONS == {"xxh3_128": "xxhash"}
    for make in (
        lambda: get_hash_fn("xxh3_128"),
        lambda: BlockHasher.create(16, "xxh3_128"),
        lambda: KVCacheManager(8, 4, hash_fn="xxh3_128"),
        lambda: xxh3_128_block_hash(b"", [1], None),
    ):
        with pytest.raises(InvalidArgumentError, match=r"xxhash package: pip install 'tiered-kv\[xxhash\]'"):
            make()


@needs_xxhash
def test_xxh3_128_is_selectable_and_differs_from_sha256():
    h = BlockHasher.create(4, "xxh3_128")
    hashes = h.update(Request("r", list(range(12))))
    assert h.hash_fn is xxh3_128_block_hash
    assert [len(x) for x in hashes] == [16, 16, 16] and len(set(hashes)) == 3
    sha = BlockHasher.create(4, sha256_block_hash).update(Request("r", list(range(12))))
    assert [x[:16] for x in sha] != hashes
    mgr = KVCacheManager(8, 4, hash_fn="xxh3_128")
    req = Request("m", list(range(9)))
    assert mgr.get_computed_blocks(req) == ([], 0)
    assert req.block_hashes == hashes[:2]


def test_hashing_benchmark_runs_and_checks_its_digests(tmp_path):
    # A smoke run of benchmarks/bench_hashing.py, so that the script cannot rot; no timing is asserted.
    import json
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hashing.py"
    out = tmp_path / "hashing.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--requests", "20", "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["identical_sha256_digests"] is True
    schemes = [row["scheme"] for row in res["rows"]]
    assert {"sha256 before", "sha256", "fast", "hashlib.sha256 floor"} <= set(schemes)
    assert ("xxh3_128" in schemes) == (xxhash is not None)
    assert "| hashlib.sha256 floor |" in proc.stdout
