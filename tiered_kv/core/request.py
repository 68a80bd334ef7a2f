"""The request record the core needs: tokens, progress and block hashes."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.core.block import BlockHash
from tiered_kv.errors import InvalidArgumentError


@dataclass(slots=True, frozen=True)
class MultiModalFeature:
    """A multimodal input occupying prompt positions ``[offset, offset + length)``."""

    identifier: str
    offset: int
    length: int


_INT = frozenset({int})


def _check_tokens(request_id: Hashable, tokens: Sequence[int]) -> None:
    if not set(map(type, tokens)) <= _INT:  # one C-level pass (bools are refused too: their type is bool)
        bad = next(t for t in tokens if t.__class__ is not int)
        raise InvalidArgumentError(f"request {request_id!r}: token ids must be ints, got {checks.describe(bad)}")


class Request:
    """A request as the KV bookkeeping sees it.

    Invariants:
        * ``all_token_ids`` holds only final tokens: the prompt, then sampled
          output tokens.  Draft/lookahead tokens never enter it, so every hash
          computed from it is over final content.
        * ``block_hashes`` covers a prefix of the full blocks of
          ``all_token_ids`` and only grows (see :class:`BlockHasher`).
        * ``num_computed_tokens`` is advanced by the scheduler, never by the
          KV managers, exactly as in vLLM.
    """

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "max_tokens",
        "num_computed_tokens",
        "block_hashes",
        "num_preemptions",
        "lora_name",
        "mm_features",
        "cache_salt",
        "arrival_time",
        "skip_prefix_cache",
        "priority",
    )

    def __init__(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        lora_name: str | None = None,
        mm_features: Iterable[MultiModalFeature] = (),
        cache_salt: str | None = None,
        arrival_time: float = 0.0,
        skip_prefix_cache: bool = False,
        priority: int = 0,
    ) -> None:
        checks.hashable("request_id", request_id)
        if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
            raise InvalidArgumentError(
                f"request {request_id!r}: prompt_token_ids must be a sequence of ints, "
                f"got {checks.describe(prompt_token_ids)}"
            )
        if len(prompt_token_ids) == 0:
            raise InvalidArgumentError(f"request {request_id!r}: the prompt must have at least one token")
        _check_tokens(request_id, prompt_token_ids)
        if max_tokens.__class__ is not int or max_tokens < 0:
            raise InvalidArgumentError(
                f"request {request_id!r}: max_tokens must be an int >= 0, got {checks.describe(max_tokens)}"
            )
        for name, value in (("lora_name", lora_name), ("cache_salt", cache_salt)):
            if value is not None and value.__class__ is not str:
                raise InvalidArgumentError(f"request {request_id!r}: {name} must be a str or None, got {value!r}")
        if arrival_time.__class__ not in (int, float) or not math.isfinite(arrival_time):
            raise InvalidArgumentError(
                f"request {request_id!r}: arrival_time must be a finite number, got {checks.describe(arrival_time)}"
            )
        checks.flag("skip_prefix_cache", skip_prefix_cache)
        if priority.__class__ is not int:
            raise InvalidArgumentError(
                f"request {request_id!r}: priority must be an int, got {checks.describe(priority)}"
            )
        mm_features = tuple(mm_features)
        for mm in mm_features:
            if not isinstance(mm, MultiModalFeature):
                raise InvalidArgumentError(f"request {request_id!r}: mm_features must hold MultiModalFeature records")
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self.lora_name = lora_name
        self.mm_features: tuple[MultiModalFeature, ...] = tuple(mm_features)
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time
        self.skip_prefix_cache = skip_prefix_cache
        self.priority = priority  # vLLM's meaning: a lower value is served first, preempted last

    @property
    def num_tokens(self) -> int:
        """Final tokens so far: prompt plus sampled output."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled (final) tokens (an int, or a sequence of ints)."""
        if token_ids.__class__ is int:
            self.all_token_ids.append(token_ids)  # type: ignore[arg-type]
            return
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise InvalidArgumentError(
                f"request {self.request_id!r}: token_ids must be an int or a sequence of ints, "
                f"got {checks.describe(token_ids)}"
            )
        _check_tokens(self.request_id, token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, out={self.num_output_tokens}/{self.max_tokens})"
        )
