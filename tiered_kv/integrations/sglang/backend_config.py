"""What a :class:`~tiered_kv.integrations.sglang.backend.TieredKVHiCacheStorage` is configured with.

SGLang hands a dynamic backend its ``HiCacheStorageConfig`` (ranks, model name,
whether the model's KV is replicated across tensor-parallel ranks) whose
``extra_config`` is the JSON of ``--hicache-storage-backend-extra-config``.  That
JSON carries SGLang's own keys (which class to load, which interface to call)
beside ours; this module checks ours and derives the part of the namespace that
SGLang's parallel layout decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations import page_store

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys of the extra config that SGLang itself reads (its loader and its cache controller); ignored here."""

OWN_KEYS = frozenset({"model", "hash_scheme"})
"""Keys of the extra config that name the namespace (beside the page store's keys)."""

STORE_KEYS = page_store.STORE_CONFIG_KEYS
"""Keys of the extra config that configure the page store (``tiers``, ``policy``, ``staging_bytes``)."""

DEFAULT_HASH_SCHEME = "sglang-page-sha256"
"""SGLang's storage keys: the SHA-256 chain of a page's tokens over its prefix (``get_storage_hash_str``)."""


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """A checked backend configuration: what to open, and under which namespace.

    Attributes:
        store: The page store's configuration (``tiers``, ``policy``, ``staging_bytes``),
            as :func:`~tiered_kv.integrations.page_store.open_page_store` takes it.
        model: The namespace's model name (default: the model SGLang serves).
        hash_scheme: What makes a key meaningful; instances that share a medium must agree.
        rank_layout: The part of the layout tag the parallel layout decides.  It names the
            tensor-parallel rank unless the model's KV is replicated across ranks (MLA):
            two ranks holding different heads must never read each other's pages, while
            replicated pages are one object per page, shared by every rank, as SGLang's
            own backends keep them.
    """

    store: dict[str, Any]
    model: str
    hash_scheme: str
    rank_layout: str

    @classmethod
    def from_sglang(cls, storage_config: Any) -> BackendConfig:
        """Check ``storage_config`` (an SGLang ``HiCacheStorageConfig``) and its ``extra_config``.

        Raises:
            InvalidArgumentError: an unknown key, a missing or bad tier entry (a missing
                ``root``, a negative capacity, ...), no model name; nothing is opened or created.
        """
        extra = storage_config.extra_config
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise InvalidArgumentError(f"the HiCache extra config must be a mapping, got {checks.describe(extra)}")
        known = SGLANG_KEYS | OWN_KEYS | STORE_KEYS
        unknown = set(extra) - known
        if unknown:
            raise InvalidArgumentError(
                f"unknown keys {sorted(unknown)} in the HiCache extra config of tiered_kv's backend "
                f"(known: {sorted(known)})"
            )
        store = {k: extra[k] for k in STORE_KEYS if k in extra}
        # SGLang builds its backend before it registers the host memory pool whose geometry gives the
        # page size, so the store is opened only then; a bad configuration must still fail now, and
        # without creating anything: open_page_store's own checks, run without opening a medium.
        page_store.check_page_store_config(store)
        model = extra.get("model", storage_config.model_name)
        for name, value in (("model", model), ("hash_scheme", extra.get("hash_scheme", DEFAULT_HASH_SCHEME))):
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(
                    f"the HiCache extra config's {name!r} must be a non-empty string "
                    f"(SGLang gave no model name, so set 'model'), got {checks.describe(value)}"
                )
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            if any(t["type"] == "disk" for t in store["tiers"]):
                raise InvalidArgumentError(
                    "MLA pages are shared by every tensor-parallel rank (one rank writes, all read), but a disk "
                    "tier's directory is owned by one process: use a Redis tier for an MLA model with tp_size > 1"
                )
        return cls(
            store=store,
            model=model,
            hash_scheme=extra.get("hash_scheme", DEFAULT_HASH_SCHEME),
            rank_layout=rank_layout(storage_config),
        )


def rank_layout(storage_config: Any) -> str:
    """The layout tag's parallel part: which shard of each page this rank holds.

    Pipeline stages hold different layers and context-parallel ranks different slices,
    so both are always named; the tensor-parallel and data-parallel ranks are named unless
    pages are replicated across ranks (``is_mla_model``: MLA's latent KV is the same on every
    rank, and SGLang lets one rank write it for all).
    """
    c = storage_config
    parts = [] if c.is_mla_model else [f"tp{c.tp_rank}/{c.tp_size}"]
    parts.append(f"pp{c.pp_rank}/{c.pp_size}")
    parts.append(f"cp{c.attn_cp_rank}/{c.attn_cp_size}")
    if c.dcp_size > 1:
        parts.append(f"dcp{c.dcp_rank}/{c.dcp_size};tp{c.tp_size};page{c.logical_page_size}")
    if not c.is_mla_model:
        # With data-parallel attention the same tensor-parallel rank exists in every group; each
        # group's process keeps its own pages (a disk tier's directory has one owner).
        parts.append(f"dp{c.dp_rank}")
    return ";".join(parts)
