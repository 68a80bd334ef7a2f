"""The plug-in's settings, read from LMCache's ``extra_config["storage_plugin.<name>.*"]`` keys.

LMCache hands a storage plug-in its whole engine configuration and nothing else, so
the plug-in finds its own keys there: every key that starts with
``storage_plugin.<name>.``, where ``<name>`` is the entry of ``storage_plugins`` whose
``module_path`` and ``class_name`` name this plug-in.  Two spellings of the tiers are
accepted, because LMCache's configuration arrives from YAML (nested values) or from the
``LMCACHE_EXTRA_CONFIG`` environment variable (JSON, often flattened by tools):

* ``storage_plugin.<name>.tiers``: a list of tier mappings, or that list as a JSON string;
* ``storage_plugin.<name>.tiers.<i>.<key>``: one tier key per entry, ``<i>`` = 0, 1, ...

Everything is checked before anything is opened: an unknown key is an error that names
the known ones, and a key LMCache itself reads (``module_path``, ``class_name``) is left to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import ConfigError
from tiered_kv.tiers.io_engine import FaultHook

PREFIX = "storage_plugin."
LMCACHE_KEYS = frozenset({"module_path", "class_name"})
OUR_KEYS = frozenset({"tiers", "policy", "staging_bytes", "model", "hash_scheme", "put_workers", "fault_hook"})
DEFAULT_PUT_WORKERS = 2


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """One plug-in instance's settings.

    Attributes:
        name: The plug-in's name in LMCache's ``storage_plugins`` (its backend name in LMCache).
        store_config: The configuration :func:`~tiered_kv.integrations.page_store.open_page_store` takes.
        model: Namespace model name, or ``None`` for LMCache's model name.
        hash_scheme: Namespace hash scheme, or ``None`` for one derived from LMCache's chunk hash algorithm.
        put_workers: Threads that write put tasks.
        fault_hook: An I/O fault hook for the stores (in-process configurations only: tests).
    """

    name: str
    store_config: dict[str, Any]
    model: str | None
    hash_scheme: str | None
    put_workers: int
    fault_hook: FaultHook | None


def plugin_names(
    extra_config: Mapping[str, Any] | None, storage_plugins: Any, module_paths: set[str], class_name: str
) -> list[str]:
    """The names in ``storage_plugins`` whose ``module_path`` and ``class_name`` keys name this plug-in."""
    if not extra_config or not storage_plugins:
        return []
    found = []
    for name in dict.fromkeys(storage_plugins):
        module = extra_config.get(f"{PREFIX}{name}.module_path")
        cls = extra_config.get(f"{PREFIX}{name}.class_name")
        if module in module_paths and cls == class_name:
            found.append(name)
    return found


def read_settings(extra_config: Mapping[str, Any], name: str) -> PluginSettings:
    """This plug-in's settings from ``extra_config``.

    Raises:
        ConfigError: an unknown key under ``storage_plugin.<name>.``, both spellings of the tiers,
            a tier list that is not a list, a flattened tier index that skips one, a bad value.
    """
    head = f"{PREFIX}{name}."
    ours = {k[len(head) :]: v for k, v in extra_config.items() if isinstance(k, str) and k.startswith(head)}
    flat: dict[int, dict[str, Any]] = {}
    plain: dict[str, Any] = {}
    for key, value in ours.items():
        if key in LMCACHE_KEYS:
            continue
        if key.startswith("tiers."):
            index, _, field = key[len("tiers.") :].partition(".")
            if not index.isdigit() or not field:
                raise ConfigError(f"extra_config key {head}{key!r}: a flattened tier key is {head}tiers.<index>.<key>")
            flat.setdefault(int(index), {})[field] = value
            continue
        if key not in OUR_KEYS:
            known = sorted(OUR_KEYS - {"fault_hook"} | {"tiers.<index>.<key>"})
            raise ConfigError(f"unknown extra_config key {head}{key} (known keys under {head}: {known})")
        plain[key] = value
    tiers = _tiers(head, plain.pop("tiers", None), flat)
    store_config: dict[str, Any] = {"tiers": tiers}
    for key in ("policy", "staging_bytes"):
        if key in plain:
            store_config[key] = plain[key]
    model = plain.get("model")
    hash_scheme = plain.get("hash_scheme")
    for key, value in (("model", model), ("hash_scheme", hash_scheme)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"extra_config {head}{key} must be a non-empty string, got {checks.describe(value)}")
    workers = plain.get("put_workers", DEFAULT_PUT_WORKERS)
    if workers.__class__ is not int or workers < 1:
        raise ConfigError(f"extra_config {head}put_workers must be a positive int, got {checks.describe(workers)}")
    hook = plain.get("fault_hook")
    if hook is not None and not callable(hook):
        raise ConfigError(f"extra_config {head}fault_hook must be callable, got {checks.describe(hook)}")
    return PluginSettings(name, store_config, model, hash_scheme, workers, hook)


def _tiers(head: str, given: Any, flat: dict[int, dict[str, Any]]) -> list[Any]:
    if given is not None and flat:
        raise ConfigError(f"extra_config gives both {head}tiers and {head}tiers.<index>.<key>; give one")
    if flat:
        if sorted(flat) != list(range(len(flat))):
            raise ConfigError(
                f"extra_config {head}tiers.<index>.* indices must be 0..{len(flat) - 1}, got {sorted(flat)}"
            )
        return [flat[i] for i in range(len(flat))]
    if given is None:
        raise ConfigError(
            f"extra_config needs {head}tiers (a list of tiers, e.g. "
            f'[{{"type": "disk", "root": "/mnt/nvme/kv", "capacity_bytes": 200000000000}}])'
        )
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"extra_config {head}tiers is a string but not JSON: {exc}") from None
    if not isinstance(given, list) or not given:
        raise ConfigError(f"extra_config {head}tiers must be a non-empty list of tiers, got {checks.describe(given)}")
    return given
