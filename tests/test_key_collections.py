"""Every verb that takes keys takes any collection of them, as vLLM 0.33's protocol does.

vLLM 0.33's ``OffloadingManager`` types its keys ``Collection[OffloadKey]`` (its
connector completes stores with a ``set``).  Each case drives two identical
chains (a CPU store over a disk store over a remote store) through the same
operations: one gets lists, the other the same keys as another collection.
Every answer, every move and every store's entries must come out the same, the
list holding the keys in the collection's iteration order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator

import pytest
from tierutil import NS, key

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiers.chain import TierChain, TierPolicy
from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.redis_store import RedisStore

fakeredis = pytest.importorskip("fakeredis")


class Keys(Collection):
    """A collection of one's own: neither a list, a tuple nor a set."""

    def __init__(self, items: list) -> None:
        self._items = list(items)

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._items


KINDS: dict[str, Callable[[list], Collection]] = {
    "set": set,
    "frozenset": frozenset,
    "deque": deque,
    "dict keys": lambda ks: dict.fromkeys(ks).keys(),
    "a Collection subclass": Keys,
}


class World:
    def __init__(self, root) -> None:
        self.cpu = CPUStore(6)
        self.disk = DiskStore(root, NS, 4 * 4096)
        self.remote = RedisStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()), NS, index_blocks=8)
        policies = (TierPolicy("write_through"), TierPolicy("write_back", writeback_reserve=2), TierPolicy("none"))
        self.chain = TierChain(list(zip((self.cpu, self.disk, self.remote), policies, strict=True)))

    def state(self) -> tuple:
        stores = [(s.entries(), s.free_block_ids(), s.stats) for s in (self.cpu, self.disk, self.remote)]
        return (*stores, self.chain.open_moves)

    def close(self) -> None:
        self.disk.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_chain_and_every_store_answer_for_any_collection_as_for_the_list(tmp_path, kind):
    a, b = World(tmp_path / "a"), World(tmp_path / "b")
    make = KINDS[kind]

    def both(call: Callable[[World, Collection], object], keys: list) -> object:
        coll = make(keys)
        expected = call(a, list(coll))
        got = call(b, coll)
        assert got == expected, f"{kind}: {got!r} != {expected!r}"
        assert b.state() == a.state()
        return expected

    try:
        head = [key(i) for i in range(4)]
        out = both(lambda w, ks: w.cpu.prepare_store(ks), head)
        both(lambda w, ks: w.cpu.complete_store(ks), out.keys_to_store)
        both(lambda w, ks: w.chain.lookup(ks).tiers, head)
        both(lambda w, ks: w.chain.after_store(0, ks), head)
        both(lambda w, ks: w.cpu.lookup_prefix(ks), head)
        both(lambda w, ks: (w.cpu.room_for(ks), w.cpu.missing(ks)), [key(0), key(9)])
        move = both(lambda w, ks: w.chain.demote(0, ks), head[:3])
        landed = list(move.keys[:2])
        both(lambda w, ks: w.chain.finish(w.chain.open_moves[0], ks), landed)
        both(lambda w, ks: w.chain.lookup(ks).tiers, head)
        both(lambda w, ks: w.chain.only_copies(0, ks), head)
        both(lambda w, ks: w.cpu.remove(ks), landed[:1])
        both(lambda w, ks: w.chain.lookup(ks).tiers, head)  # landed[0] now on disk only
        staged = both(lambda w, ks: w.chain.stage(ks, 1), landed[:1])
        both(lambda w, ks: w.chain.finish(w.chain.open_moves[0], ks), list(staged.keys))
        both(lambda w, ks: w.disk.forget(ks), landed[1:])
        both(lambda w, ks: w.disk.lookup_prefix(ks), head)
        both(lambda w, ks: (w.remote.lookup_prefix(ks), w.remote.probe(ks)), head)
        spec = both(lambda w, ks: w.cpu.prepare_load(ks).block_ids, head[1:3])
        assert len(spec) == 2
        both(lambda w, ks: w.cpu.touch(ks), head)
        both(lambda w, ks: w.cpu.complete_load(ks), head[1:3])
        failed = both(lambda w, ks: w.cpu.prepare_store(ks), [key(7), key(8)])
        both(lambda w, ks: w.cpu.complete_store(ks, False), failed.keys_to_store)

        ctx_a, ctx_b = RequestContext("r"), RequestContext("r")
        coll = make(head)
        ctx_a.set_positions(list(coll), 4, 4)
        ctx_b.set_positions(coll, 4, 4)
        assert [ctx_b.position(k) for k in head] == [ctx_a.position(k) for k in head]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("bad", ["abc", b"abc", {key(1): 1}, iter([key(1)]), None])
def test_what_is_not_a_collection_of_keys_is_refused_by_the_chain_with_a_clear_error(tmp_path, bad):
    w = World(tmp_path)
    try:
        before = w.state()
        with pytest.raises(InvalidArgumentError, match="keys must be a collection of keys"):
            w.chain.lookup(bad)
        assert w.state() == before
    finally:
        w.close()
