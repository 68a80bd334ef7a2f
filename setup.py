"""Build hook: compile the bookkeeping core with mypyc on request, else a pure-Python package.

Everything else about the package is in ``pyproject.toml``.  With
``TIERED_KV_MYPYC=1`` in the environment, a wheel (``pip wheel .`` or
``pip install .``) carries the modules in ``COMPILED`` as C extensions built by
mypyc, next to their ``.py`` sources; this is how mypy and black ship
themselves.  Without it, or when no C compiler (or no Python headers) is
present, the package is pure Python and behaves identically, only slower
(``tiered_kv.core.COMPILED`` says which one runs).  The decision table and the
numbers are in ``docs/benchmarks.md``.

Editable installs (``pip install -e .``) stay pure: a compiled module next to
its source would shadow every later edit of that source.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The hot bookkeeping: blocks, free queue, pool, manager, request, counters.  Hashing
# is left out: it is bound by hashlib, and compiling it measured no faster.  The scheduler,
# the tier manager and the simulator's loop type-check strictly too (pyproject's
# [tool.mypy] files) but stay interpreted: compiled, their int-typed public arguments
# raise mypyc's bare TypeError before the package's own checks run (docs/benchmarks.md,
# "Simulator speed", says what compiling them needs).
COMPILED = [
    "tiered_kv/core/block.py",
    "tiered_kv/core/compile_hints.py",
    "tiered_kv/core/free_queue.py",
    "tiered_kv/core/pool_checks.py",
    "tiered_kv/core/pool_cache.py",
    "tiered_kv/core/block_pool.py",
    "tiered_kv/core/request.py",
    "tiered_kv/core/kv_cache_manager.py",
    "tiered_kv/core/stats.py",
]
MYPY = "mypy==2.4.1"  # mypyc ships inside mypy; pinned so that every build compiles the same C


def _warn(message: str) -> None:
    print(f"tiered-kv build: {message}; building the pure-Python core", file=sys.stderr)


def _compiler_works() -> bool:
    """Whether a C compiler is here and finds ``Python.h`` (what a mypyc extension needs)."""
    from distutils.ccompiler import new_compiler
    from distutils.sysconfig import customize_compiler, get_python_inc

    compiler = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp, "probe.c")
        probe.write_text("#include <Python.h>\nint probe(void) { return 0; }\n")
        try:
            compiler.compile([str(probe)], output_dir=tmp, include_dirs=[get_python_inc()])
        except Exception:  # distutils raises CompileError, or OSError without an executable
            return False
    return True


class OptionalBuildExt(build_ext):
    """Build the extensions; if that fails after all, remove what was built and stay pure Python.

    A wheel must never carry part of a multi-module mypyc build: the modules'
    stubs import one shared library, so a partial build would not import.
    """

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler or linker failure: distutils' error types vary
            _warn(f"the C extensions could not be built ({type(exc).__name__}: {exc})")
            for ext in self.extensions:
                for path in (self.get_ext_fullpath(ext.name), self.get_ext_filename(ext.name)):
                    Path(path).unlink(missing_ok=True)
            self.extensions = []


def ext_modules() -> list:
    if os.environ.get("TIERED_KV_MYPYC", "0") != "1":
        return []
    if "editable_wheel" in sys.argv or "develop" in sys.argv:
        _warn("an editable install stays pure Python")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        # First pass of an isolated build: ``setup_requires`` below brings mypy in.
        return []
    if not _compiler_works():
        _warn("no working C compiler (or no Python headers)")
        return []
    return mypycify(COMPILED, opt_level="3", group_name="tiered_kv_core")


setup(
    ext_modules=ext_modules(),
    cmdclass={"build_ext": OptionalBuildExt},
    setup_requires=[MYPY] if os.environ.get("TIERED_KV_MYPYC", "0") == "1" else [],
)
