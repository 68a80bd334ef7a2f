"""A cache policy defined outside the package, for the tests of policy registration by module path."""

from __future__ import annotations

from collections import OrderedDict

from tiered_kv.tiers.policies import CachePolicy


class FIFOPolicy(CachePolicy):
    """First stored, first evicted; uses change nothing."""

    name = "fifo"

    def __init__(self, capacity, is_ready):
        super().__init__(capacity, is_ready)
        self._keys = OrderedDict()

    def __len__(self):
        return len(self._keys)

    def __contains__(self, key):
        return key in self._keys

    def order(self):
        return list(self._keys)

    def snapshot(self):
        return (tuple(self._keys),)

    def insert(self, key, req):
        self._keys[key] = None

    def remove(self, key):
        del self._keys[key]

    def touch(self, keys, req):
        return

    def evict(self, n, protected, evictable):
        victims = [k for k in self._keys if evictable(k) and k not in protected][:n]
        if len(victims) < n:
            return None
        for k in victims:
            del self._keys[k]
        return victims

    def clear(self):
        self._keys.clear()
