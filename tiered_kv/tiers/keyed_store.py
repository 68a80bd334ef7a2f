"""What the disk and remote stores share: CPUStore's bookkeeping, a slot-to-key map and media hooks.

The bookkeeping of a store below the CPU is exactly the CPU store's: pending
and ready entries, pins, a cache policy, all-or-nothing ``prepare_store``,
events.  Only the meaning of a *slot* differs.  In the CPU tier a slot is a
block of the pinned tensor; here it is one unit of capacity (one block file,
one entry of the local index of a remote store), and the bytes are found by
key, not by slot.  So these stores reuse :class:`~tiered_kv.tiers.cpu_store.CPUStore`
and add:

* a slot -> key map (:meth:`key_at`), which an I/O engine reads when a plan is
  submitted (on the caller's thread: the store itself is single-threaded);
* hooks that tell the medium when an entry leaves (``_on_evicted``,
  ``_on_removed``, ``_on_store_failed``), so the disk store deletes files and
  the remote store deletes server keys where that is right;
* :meth:`forget`, which drops entries whose bytes turned out to be bad or gone;
* a key check: only block hashes (``bytes`` or ``int``) can be named in a
  shared medium; a request's private key objects stay in the CPU tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_kv import checks
from tiered_kv.errors import BlockStateError, InvalidArgumentError, PlanError
from tiered_kv.tiers.cpu_store import CPUStore, check_keys
from tiered_kv.tiers.namespace import MAX_KEY_BYTES, encodable
from tiered_kv.tiers.store import Key, PrepareStoreOutput


class KeyedStore(CPUStore):
    """A :class:`CPUStore` whose slots are capacity units of a medium addressed by key.

    Invariants (beyond the CPU store's): :meth:`key_at` answers for exactly
    the resident entries' slots; every resident key is :func:`encodable`; a key
    passed to :meth:`forget` while pinned is dropped when its last load completes.
    """

    medium = "KEYED"

    def __init__(self, num_blocks: int, policy: str = "lru", enable_events: bool = False) -> None:
        super().__init__(num_blocks, policy=policy, enable_events=enable_events)
        self._key_at: dict[int, Key] = {}
        self._slot_of: dict[Key, int] = {}
        self._doomed: set[Key] = set()  # forgotten while pinned: dropped at the last complete_load

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self.capacity}, used={self.num_used}, "
            f"pending={self.num_pending}, pinned={self.num_pinned})"
        )

    # ------------------------------------------------------------ the map
    def key_at(self, slot: int) -> Key:
        """The key resident in ``slot`` (an I/O engine resolves a plan's slots with it).

        Raises:
            BlockStateError: no entry holds ``slot``.
        """
        checks.count("slot", slot, 1)
        key = self._key_at.get(slot)
        if key is None:
            raise BlockStateError(f"slot {slot} of the {self.medium} store holds no entry")
        return key

    def plan_keys(self, plan_id: int, op: str, slots: Sequence[int]) -> tuple[Key, ...]:
        """The keys of a ``"load"`` or ``"store"`` plan's slots on this store's side, in plan order.

        Raises:
            PlanError: a slot holds no entry, or its entry is not ready (a load) or not pending (a store).
        """
        keys = []
        for i, slot in enumerate(slots):
            try:
                key = self.key_at(slot)
            except BlockStateError as exc:
                raise PlanError(f"plan {plan_id}: {exc}") from None
            if self.is_ready(key) != (op == "load"):
                want = "ready (prepare_load)" if op == "load" else "pending (prepare_store)"
                raise PlanError(f"plan {plan_id}: slot {slot} (position {i}) of the {self.medium} store is not {want}")
            keys.append(key)
        return tuple(keys)

    def _unmap(self, keys: Sequence[Key]) -> None:
        for key in keys:
            del self._key_at[self._slot_of.pop(key)]
            self._doomed.discard(key)

    # ---------------------------------------------------------- the verbs
    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        keys = check_keys("keys", keys)
        for i, key in enumerate(keys):
            if not encodable(key):
                raise InvalidArgumentError(
                    f"keys[{i}] = {checks.describe(key)} cannot be stored in the {self.medium} store: "
                    f"only block hashes (bytes of 1..{MAX_KEY_BYTES}, or int) have a name there"
                )
        out = super().prepare_store(keys)
        if out is None:
            return None
        self._unmap(out.evicted_keys)
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self._key_at[slot] = key
            self._slot_of[key] = slot
        if out.evicted_keys:
            self._on_evicted(out.evicted_keys)
        return out

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        keys = check_keys("keys", keys)
        checks.flag("success", success)
        dropped = [] if success else [key for key in keys if self.contains(key) and not self.is_ready(key)]
        super().complete_store(keys, success)
        if dropped:
            self._unmap(dropped)
            self._on_store_failed(dropped)

    def remove(self, keys: Sequence[Key]) -> None:
        keys = check_keys("keys", keys)
        super().remove(keys)
        self._unmap(keys)
        if keys:
            self._on_removed(keys)

    def complete_load(self, keys: Sequence[Key]) -> None:
        super().complete_load(keys)
        if self._doomed:
            due = [key for key in keys if key in self._doomed and self._unpinned(key)]
            if due:
                self._drop_bad(due)

    def forget(self, keys: Sequence[Key]) -> list[Key]:
        """Drop entries whose bytes in the medium are known to be bad or gone.

        A load that found a block missing or corrupt reports it here.  Ready,
        unpinned entries go at once; pinned ones when their last load completes
        (a load still reading the slot must finish first); pending and absent
        keys are ignored.  The medium's copy is dropped too where it is this
        store's own (a corrupt disk file); a shared medium keeps other writers' data.

        Returns:
            The keys dropped now.
        """
        keys = check_keys("keys", keys)
        now = []
        for key in keys:
            if self.is_ready(key):
                if self._unpinned(key):
                    now.append(key)
                else:
                    self._doomed.add(key)
        if now:
            self._drop_bad(now)
        return now

    def _unpinned(self, key: Key) -> bool:
        # room_for protects the keys it is given that are ready and unpinned, and only those: so a
        # ready key changes the answer exactly when no load pins it.  The pin count stays the CPU
        # store's own fact instead of being mirrored here.
        return self.room_for([]) != self.room_for([key])

    def _drop_bad(self, keys: list[Key]) -> None:
        CPUStore.remove(self, keys)
        self._unmap(keys)
        self._on_forgotten(keys)

    # ----------------------------------------------------- media hooks
    def _on_evicted(self, keys: list[Key]) -> None:
        """Entries evicted to make room."""

    def _on_removed(self, keys: Sequence[Key]) -> None:
        """Entries the caller removed."""

    def _on_store_failed(self, keys: list[Key]) -> None:
        """Pending entries dropped because their store failed."""

    def _on_forgotten(self, keys: list[Key]) -> None:
        """Entries dropped by :meth:`forget`."""

    def check_invariants(self) -> None:
        super().check_invariants()
        resident = {e.key: e.block_id for e in self.entries()}
        assert self._slot_of == resident, "slot map and entries disagree"
        assert {s: k for k, s in resident.items()} == self._key_at, "key map and entries disagree"
        assert self._doomed <= set(resident), "a doomed key is not resident"
        assert all(encodable(k) for k in resident), "a resident key cannot be named in the medium"
