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


def _check_tokens(request_id: Hashable, tokens: Sequence[object]) -> None:
    # Items typed ``object``: compiled, an ``int`` item type would be enforced before the check.
    if not set(map(type, tokens)) <= _INT:  # one C-level pass (bools are refused too: their type is bool)
        bad = next(t for t in tokens if type(t) is not int)
        raise InvalidArgumentError(f"request {request_id!r}: token ids must be ints, got {checks.describe(bad)}")


def _items(values: Iterable[object]) -> tuple[object, ...]:
    return tuple(values)


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
        "prefix_hashes",
        "prefix_block_size",
    )

    def __init__(
        self,
        request_id: Hashable,
        prompt_token_ids: object,
        max_tokens: object = 16,
        *,
        lora_name: object = None,
        mm_features: Iterable[MultiModalFeature] = (),
        cache_salt: object = None,
        arrival_time: object = 0.0,
        skip_prefix_cache: object = False,
        priority: object = 0,
    ) -> None:
        checks.hashable("request_id", request_id)
        if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
            raise InvalidArgumentError(
                f"request {request_id!r}: prompt_token_ids must be a sequence of ints, "
                f"got {checks.describe(prompt_token_ids)}"
            )
        # An empty prompt is a valid record, as vLLM's ``Request`` is (its KV manager allocates for one:
        # vLLM's test_allocate_with_lookahead); what cannot be served is refused where it would be
        # served (``Scheduler.add_request``, ``TierManager.admit``), as vLLM's input processor refuses it.
        _check_tokens(request_id, prompt_token_ids)
        # At least one token, as vLLM's SamplingParams requires ("max_tokens must be at least 1"): a
        # request is prefilled in order to sample, and one allowed no token would be finished on
        # arrival, holding KV for nothing.
        if type(max_tokens) is not int or max_tokens < 1:
            raise InvalidArgumentError(
                f"request {request_id!r}: max_tokens must be an int >= 1 (as vLLM's SamplingParams: a request "
                f"samples at least one token), got {checks.describe(max_tokens)}"
            )
        if lora_name is not None and type(lora_name) is not str:
            raise InvalidArgumentError(f"request {request_id!r}: lora_name must be a str or None, got {lora_name!r}")
        if cache_salt is not None and type(cache_salt) is not str:
            raise InvalidArgumentError(f"request {request_id!r}: cache_salt must be a str or None, got {cache_salt!r}")
        if (type(arrival_time) is not int and type(arrival_time) is not float) or not math.isfinite(arrival_time):
            raise InvalidArgumentError(
                f"request {request_id!r}: arrival_time must be a finite number, got {checks.describe(arrival_time)}"
            )
        if type(skip_prefix_cache) is not bool:
            raise InvalidArgumentError(
                f"skip_prefix_cache must be True or False, got {checks.describe(skip_prefix_cache)}"
            )
        if type(priority) is not int:
            raise InvalidArgumentError(
                f"request {request_id!r}: priority must be an int, got {checks.describe(priority)}"
            )
        features: list[MultiModalFeature] = []
        for mm in _items(mm_features):
            if not isinstance(mm, MultiModalFeature):
                raise InvalidArgumentError(f"request {request_id!r}: mm_features must hold MultiModalFeature records")
            features.append(mm)
        self.request_id: Hashable = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens: int = len(self.all_token_ids)
        self.max_tokens: int = max_tokens
        self.num_computed_tokens: int = 0
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions: int = 0
        self.lora_name: str | None = lora_name
        self.mm_features: tuple[MultiModalFeature, ...] = tuple(features)
        self.cache_salt: str | None = cache_salt
        self.arrival_time: float = arrival_time
        self.skip_prefix_cache: bool = skip_prefix_cache
        self.priority: int = priority  # vLLM's meaning: a lower value is served first, preempted last
        # Set only by from_hashes: the prompt's content is known by these keys, not by its tokens.
        self.prefix_hashes: tuple[int, ...] | None = None
        self.prefix_block_size: int = 0

    @classmethod
    def from_hashes(
        cls,
        request_id: Hashable,
        num_prompt_tokens: object,
        hashes: object,
        hash_block_size: object,
        max_tokens: object = 16,
        *,
        arrival_time: object = 0.0,
        priority: object = 0,
    ) -> Request:
        """A request whose prompt is given as block hashes instead of token ids (a trace's ``hash_ids``).

        ``hashes[j]`` identifies prompt tokens ``[j * hash_block_size, (j + 1) * hash_block_size)``
        *together with everything before them* (a chained hash, as Mooncake's traces
        give them), so two requests have the same ``hashes[j]`` exactly when they share
        that whole prefix.  The list must cover the prompt exactly: ``ceil(num_prompt_tokens
        / hash_block_size)`` entries, the last one for a partial block where the prompt
        ends inside it.

        The block hasher keys the pool's blocks on these directly, re-chunked to the
        pool's own block size (see :meth:`BlockHasher.update`).  ``all_token_ids``
        holds ``num_prompt_tokens`` zeros for the prompt, one shared int object: the
        core counts and slices that list on its hot paths, and the zeros stand for
        the content the hashes identify (the one block that mixes prompt and output
        tokens is keyed from the last hash, so equal zeros never mean equal content
        across different prompts).  Memory per request is one pointer per token,
        with no per-token objects; nothing is tokenized.

        Raises:
            InvalidArgumentError: a count that is not an int >= 1, a hash that is not
                an int in ``[0, 2**63)``, or a hash list that does not cover the prompt exactly.
        """
        checks.hashable("request_id", request_id)
        if type(num_prompt_tokens) is not int or num_prompt_tokens < 1:
            raise InvalidArgumentError(
                f"request {request_id!r}: num_prompt_tokens must be an int >= 1, "
                f"got {checks.describe(num_prompt_tokens)}"
            )
        if type(hash_block_size) is not int or hash_block_size < 1:
            raise InvalidArgumentError(
                f"request {request_id!r}: hash_block_size must be an int >= 1, got {checks.describe(hash_block_size)}"
            )
        if isinstance(hashes, str | bytes) or not isinstance(hashes, Sequence):
            raise InvalidArgumentError(
                f"request {request_id!r}: hashes must be a sequence of ints, got {checks.describe(hashes)}"
            )
        keys = _items(hashes)
        for h in keys:
            if type(h) is not int or h < 0 or h >= 1 << 63:  # a hash is packed as an int64 by the digest chains
                raise InvalidArgumentError(
                    f"request {request_id!r}: hashes must be ints in [0, 2**63), got {checks.describe(h)}"
                )
        need = -(-num_prompt_tokens // hash_block_size)
        if len(keys) != need:
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_prompt_tokens} prompt tokens in blocks of {hash_block_size} "
                f"need {need} hashes, got {len(keys)}"
            )
        req = cls(request_id, [0] * num_prompt_tokens, max_tokens, arrival_time=arrival_time, priority=priority)
        req.prefix_hashes = tuple(h for h in keys if type(h) is int)
        req.prefix_block_size = hash_block_size
        return req

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

    def append_output_token_ids(self, token_ids: object) -> None:
        """Append sampled (final) tokens (an int, or a sequence of ints)."""
        if type(token_ids) is int:
            self.all_token_ids.append(token_ids)
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
