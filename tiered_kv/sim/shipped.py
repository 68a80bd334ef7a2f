"""The configs that ship inside the package: experiments, hardware profiles and model profiles.

The repository keeps them in its top-level ``configs/`` directory; the package
reaches them as ``tiered_kv/configs`` (a link in the source tree, real files
in a wheel) and reads them with :mod:`importlib.resources`, so an installed
``tiered-kv`` finds ``hardware: l40s`` wherever it runs from.
"""

from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING

from tiered_kv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

KINDS = ("experiments", "hardware", "models", "validation")


def _dir(kind: str) -> Traversable:
    root = files("tiered_kv").joinpath("configs")
    return root if kind == "experiments" else root.joinpath(kind)


def shipped(kind: str, name: str) -> Traversable | None:
    """The shipped ``<name>.yaml`` of ``kind`` (one of :data:`KINDS`), or None if there is none."""
    if kind not in KINDS:
        raise InvalidArgumentError(f"kind must be one of {KINDS}, got {kind!r}")
    f = _dir(kind).joinpath(f"{name}.yaml")
    return f if f.is_file() else None


def shipped_names(kind: str) -> list[str]:
    """Names (file stems) of the shipped configs of ``kind``, sorted."""
    d = _dir(kind)
    if not d.is_dir():
        return []
    return sorted(f.name.removesuffix(".yaml") for f in d.iterdir() if f.name.endswith(".yaml") and f.is_file())
