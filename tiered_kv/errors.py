"""The package's error hierarchy.

Every misuse raises a subclass of :class:`TieredKVError` whose message names
what was wrong.  An *expected* shortage ("these blocks do not fit") is never an
exception: callers get ``None`` back and no state changes.  The subclasses also
derive from the built-in exception a Python user would reach for first
(``ValueError``, ``KeyError``), so ``except ValueError`` keeps working for code
written against vLLM, whose pool raises ``ValueError``.
"""

from __future__ import annotations


class TieredKVError(Exception):
    """Base class of every error raised by tiered_kv."""


class InvalidArgumentError(TieredKVError, ValueError):
    """An argument is out of range or of the wrong kind (negative count, bad size)."""


class NotEnoughFreeBlocksError(TieredKVError, ValueError):
    """More blocks were requested from a pool than it has free."""


class BlockStateError(TieredKVError, ValueError):
    """A block was used in a way its state forbids (double free, null block, foreign block)."""


class HashingError(TieredKVError, ValueError):
    """A block hash was requested for a block that is not full or not final."""


class UnknownRequestError(TieredKVError, KeyError):
    """A request id is not known to the manager it was given to."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class RequestStateError(TieredKVError, ValueError):
    """A store's request hook was called out of order (finished before new, a key position moved back)."""


class InvalidTransitionError(TieredKVError, ValueError):
    """A request state transition that is impossible from the current state."""


class PlanError(TieredKVError, ValueError):
    """A transfer plan is malformed or does not match the state it acts on."""


class TransferError(TieredKVError, RuntimeError):
    """A copy failed or was cancelled; the plan's source blocks are intact."""


class ConfigError(TieredKVError, ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""


class StorageError(TieredKVError, RuntimeError):
    """KV storage could not be allocated or pinned."""


class ConcurrentUseError(TieredKVError, RuntimeError):
    """A single-threaded object was entered by a second thread while the first was inside."""


class ResourceLimitError(ConfigError):
    """A run would need more memory or time than this machine has; the message gives the estimate."""


class MissingDependencyError(TieredKVError, ImportError):
    """An optional dependency is not installed (or fails to import); the message names the extra to install."""


class OutputError(TieredKVError, OSError):
    """An output path cannot be written (a directory, a file in the way, no permission)."""
