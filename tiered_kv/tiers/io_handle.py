"""Per-block outcomes of I/O below the CPU tier, and the handle that carries them (standard library only).

A memory copy lands whole or not at all; a block's file or server I/O fails on
its own (a full disk, a corrupt file, a server that went away) while its
neighbours succeed.  So a :class:`BlockIOHandle` is a
:class:`~tiered_kv.transfer.plan.TransferHandle` that also says, per block,
what happened.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tiered_kv.tiers.store import Key
from tiered_kv.transfer.plan import TransferHandle


class BlockOutcome(str, enum.Enum):
    """What happened to one block of a plan."""

    OK = "ok"  # the bytes moved
    PRESENT = "present"  # store: the medium already held the block (another writer); nothing written, loadable
    BUSY = "busy"  # store: another writer is storing it now; nothing written, not loadable yet
    MISSING = "missing"  # load: the medium no longer holds it (deleted, expired)
    CORRUPT = "corrupt"  # load: not a whole block of this namespace and key (torn, foreign, bit rot)
    NO_SPACE = "no_space"  # store: the medium is full
    ERROR = "error"  # any other failure: permission, timeout, lost connection
    CANCELLED = "cancelled"  # not attempted: the plan was cancelled first

    @property
    def landed(self) -> bool:
        """Whether the block is now where the plan took it (for a store: loadable from the medium)."""
        return self in (BlockOutcome.OK, BlockOutcome.PRESENT)


@dataclass(eq=False)
class BlockIOHandle(TransferHandle):
    """A :class:`TransferHandle` with one outcome per block of the plan.

    Attributes:
        keys: The key of each block, in plan order.
        outcomes: One per block, in plan order; final once :meth:`done`.
    """

    keys: tuple[Key, ...] = ()
    outcomes: list[BlockOutcome] = field(default_factory=list)
    _cancel_requested: bool = field(default=False, repr=False)
    _batches_left: int = field(default=0, repr=False)

    def landed_keys(self) -> list[Key]:
        """Keys whose block landed (``OK`` or ``PRESENT``), in plan order."""
        return [k for k, o in zip(self.keys, self.outcomes, strict=True) if o.landed]

    def keys_with(self, *outcomes: BlockOutcome) -> list[Key]:
        """Keys whose outcome is one of ``outcomes``, in plan order."""
        return [k for k, o in zip(self.keys, self.outcomes, strict=True) if o in outcomes]
