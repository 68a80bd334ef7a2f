"""Hints for the mypyc build of the core (see ``setup.py``), harmless without it.

``mypyc_attr(allow_interpreted_subclasses=True)`` lets Python code subclass a
compiled class (as the pure class always allows), at the price of slower
overridable calls from compiled code; the pool benchmark measured no
difference for ``BlockPool``.  The decorator comes from ``mypy_extensions``
where that is installed, which mypyc needs in order to see it; otherwise it is
an identity function: the pure-Python core needs nothing beyond the standard
library, and both variants return the class unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

_C = TypeVar("_C")

try:
    from mypy_extensions import mypyc_attr
except ImportError:

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[_C], _C]:
        return lambda cls: cls


__all__ = ["mypyc_attr"]
