"""Engine configs for tests, written flat: each keyword goes to the config that owns it."""

from __future__ import annotations

import dataclasses

from tiered_kv.engine.engine_config import EngineConfig
from tiered_kv.manager import ManagerConfig
from tiered_kv.sched import SchedulerConfig

_MANAGER = {f.name for f in dataclasses.fields(ManagerConfig)}
_SCHEDULER = {f.name for f in dataclasses.fields(SchedulerConfig)}


def engine_config(**flat: object) -> EngineConfig:
    """``EngineConfig`` from the engine's defaults, each keyword set in the part that owns it."""
    base = EngineConfig()
    manager = {k: v for k, v in flat.items() if k in _MANAGER}
    scheduler = {k: v for k, v in flat.items() if k in _SCHEDULER}
    own = {k: v for k, v in flat.items() if k not in _MANAGER and k not in _SCHEDULER}
    return EngineConfig(
        manager=dataclasses.replace(base.manager, **manager),
        scheduler=dataclasses.replace(base.scheduler, **scheduler),
        **own,
    )
