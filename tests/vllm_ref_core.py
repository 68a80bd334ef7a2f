"""vLLM 0.33.0's own ``BlockPool`` and ``FreeKVCacheBlockQueue``, imported from its source for the differential tests.

``load()`` imports, from the tree that :func:`vllm_source.vllm_source` unpacks, exactly three
modules of vLLM, unchanged: ``vllm/v1/core/kv_cache_utils.py`` (blocks, the free queue, hash
helpers), ``vllm/v1/core/block_pool.py`` and ``vllm/distributed/kv_events.py`` (the event
classes), plus the pure helper ``vllm/utils/math_utils.py`` and ``vllm/utils/hashing.py``. What
those modules import from the rest of vLLM (config, logger, multimodal, metrics, the request,
the KV cache specs) and from third-party packages (``msgspec``, ``zmq``, ``cbor2``) is stubbed
with the least that lets the modules load; nothing the pool or the queue executes is stubbed,
except ``msgspec.Struct`` (the events' base class), replaced by a plain keyword/positional
record with the same field order and defaults.

The stubs sit in ``sys.modules`` only while the modules import, then every ``vllm`` entry is
taken out again, so that the rest of the suite still sees that vLLM is not installed.

``VllmRequest`` is the request record the pool reads (``block_hashes``, ``all_token_ids``,
``lora_request``, ``cache_salt``, ``mm_features``, ``prompt_embeds``, ``session_id``).
``set_int_hashes(flag)`` sets ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` for the loaded modules.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from vllm_source import vllm_source

_LOADED: types.SimpleNamespace | None = None


class _Struct:
    """Stand-in for ``msgspec.Struct``: fields from the class annotations, in order, with their defaults."""

    __struct_fields__: ClassVar[tuple[str, ...]] = ()
    __struct_defaults__: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **_options: Any) -> None:
        names: list[str] = []
        defaults: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            for name in inspect.get_annotations(klass):
                if name.startswith("__") or name in names:
                    continue
                names.append(name)
            for name in names:
                if name in klass.__dict__:
                    defaults[name] = klass.__dict__[name]
        cls.__struct_fields__ = tuple(names)
        cls.__struct_defaults__ = defaults

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self.__struct_fields__
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes {len(names)} fields")
        values = dict(zip(names, args, strict=False))
        for k, v in kwargs.items():
            if k not in names or k in values:
                raise TypeError(f"{type(self).__name__}: bad or repeated field {k!r}")
            values[k] = v
        for name in names:
            if name not in values:
                if name not in self.__struct_defaults__:
                    raise TypeError(f"{type(self).__name__}: missing field {name!r}")
                values[name] = self.__struct_defaults__[name]
            object.__setattr__(self, name, values[name])

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in self.__struct_fields__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__struct_fields__)})"


def struct_fields(event: object) -> dict[str, Any]:
    """A loaded vLLM event's fields by name, in vLLM's order."""
    assert isinstance(event, _Struct), f"not a vLLM event: {event!r}"
    return {n: getattr(event, n) for n in event.__struct_fields__}


@dataclass
class VllmLoRARequest:
    """What vLLM's pool reads of a ``LoRARequest``."""

    lora_name: str
    adapter_id: int
    lora_path: str = ""

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass
class VllmPlaceholder:
    offset: int
    length: int


@dataclass
class VllmMMFeature:
    identifier: str
    mm_position: VllmPlaceholder


@dataclass
class VllmRequest:
    """What vLLM 0.33's ``BlockPool`` reads of a request."""

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    lora_request: VllmLoRARequest | None = None
    cache_salt: str | None = None
    mm_features: list[VllmMMFeature] = field(default_factory=list)
    prompt_embeds: None = None
    session_id: str | None = None


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that submodules can be registered under it
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


class _Anything:
    """A stub class for names that are only imported (annotations, unused defaults)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("stubbed vLLM name; the pool's differential tests do not call it")


def _stubs() -> dict[str, types.ModuleType]:
    def init_logger(name: str) -> logging.Logger:
        return logging.getLogger(f"vllm_ref.{name}")

    def not_called(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("stubbed vLLM function; the pool's differential tests do not call it")

    envs = _module("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
    mods = {
        "msgspec": _module("msgspec", Struct=_Struct),
        "zmq": _module("zmq", __getattr__=lambda name: _Anything),  # names used in annotations only
        "cbor2": _module("cbor2", dumps=not_called),
        "vllm": _module("vllm", envs=envs),
        "vllm.envs": envs,
        "vllm.logger": _module("vllm.logger", init_logger=init_logger),
        "vllm.config": _module("vllm.config", VllmConfig=_Anything),
        "vllm.config.kv_events": _module("vllm.config.kv_events", KVEventsConfig=_Anything),
        "vllm.multimodal": _module("vllm.multimodal"),
        "vllm.multimodal.utils": _module("vllm.multimodal.utils", get_mm_features_in_window=not_called),
        "vllm.utils": _module("vllm.utils"),
        "vllm.utils.network_utils": _module(
            "vllm.utils.network_utils",
            get_ip=not_called,
            get_tcp_uri=not_called,
            is_valid_ipv6_address=not_called,
            split_zmq_path=not_called,
        ),
        "vllm.distributed": _module("vllm.distributed"),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.core": _module("vllm.v1.core"),
        "vllm.v1.core.kv_cache_metrics": _module("vllm.v1.core.kv_cache_metrics", KVCacheMetricsCollector=_Anything),
        "vllm.v1.kv_cache_interface": _module(
            "vllm.v1.kv_cache_interface",
            KVCacheConfig=_Anything,
            KVCacheGroupSpec=_Anything,
            KVCacheSpec=_Anything,
            MambaSpec=_Anything,
            UniformTypeKVCacheSpecs=_Anything,
            iter_layer_specs=not_called,
        ),
        "vllm.v1.kv_cache_spec_registry": _module("vllm.v1.kv_cache_spec_registry", KVCacheSpecRegistry=_Anything),
        "vllm.v1.request": _module("vllm.v1.request", Request=VllmRequest),
        "vllm.v1.utils": _module("vllm.v1.utils", tensor_data=not_called),
    }
    return mods


_REAL = (
    ("vllm.utils.math_utils", "vllm/utils/math_utils.py"),
    ("vllm.utils.hashing", "vllm/utils/hashing.py"),
    ("vllm.v1.core.kv_cache_utils", "vllm/v1/core/kv_cache_utils.py"),
    ("vllm.distributed.kv_events", "vllm/distributed/kv_events.py"),
    ("vllm.v1.core.block_pool", "vllm/v1/core/block_pool.py"),
)


def load() -> types.SimpleNamespace:
    """vLLM 0.33.0's pool modules, loaded once (skips, or fails under CI, where the source is missing)."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    root: Path = vllm_source()
    stubs = _stubs()
    saved = {k: v for k, v in sys.modules.items() if k in stubs or k.split(".")[0] == "vllm"}
    loaded: dict[str, types.ModuleType] = {}
    try:
        sys.modules.update(stubs)
        for name, rel in _REAL:
            spec = importlib.util.spec_from_file_location(name, root / rel)
            assert spec is not None and spec.loader is not None, f"cannot load {rel}"
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            parent, _, leaf = name.rpartition(".")
            setattr(sys.modules[parent], leaf, mod)
            loaded[name] = mod
    finally:
        for k in [k for k in sys.modules if k in stubs or k.split(".")[0] == "vllm"]:
            del sys.modules[k]
        sys.modules.update(saved)
    utils = loaded["vllm.v1.core.kv_cache_utils"]
    # NONE_HASH is set by vLLM's engine at start-up; the pool does not read it, the hasher does.
    utils.init_none_hash(loaded["vllm.utils.hashing"].sha256)
    envs = stubs["vllm.envs"]

    def set_int_hashes(flag: bool) -> None:
        envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = flag

    _LOADED = types.SimpleNamespace(
        root=root,
        kv_cache_utils=utils,
        block_pool=loaded["vllm.v1.core.block_pool"],
        kv_events=loaded["vllm.distributed.kv_events"],
        hashing=loaded["vllm.utils.hashing"],
        BlockPool=loaded["vllm.v1.core.block_pool"].BlockPool,
        FreeKVCacheBlockQueue=utils.FreeKVCacheBlockQueue,
        KVCacheBlock=utils.KVCacheBlock,
        set_int_hashes=set_int_hashes,
    )
    return _LOADED
