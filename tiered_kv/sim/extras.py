"""Optional dependencies: import one, or fail with the extra that provides it.

A base install of tiered-kv has no third-party dependency at all (the
bookkeeping core needs none).  The simulator's YAML configs, plots and
progress bars come with the ``sim`` extra, parallel sweeps on a cluster with
``ray``, and the real engine and copy engines need torch, which users bring
themselves on GPU machines.  Commands call :func:`import_extra` before they
start, so a missing package is one clear line, never a traceback from deep
inside a run.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from tiered_kv.errors import MissingDependencyError

# module -> (distribution a user installs, how to install it)
EXTRAS: dict[str, tuple[str, str]] = {
    "yaml": ("PyYAML", "pip install 'tiered-kv[sim]'"),
    "matplotlib": ("matplotlib", "pip install 'tiered-kv[sim]'"),
    "tqdm": ("tqdm", "pip install 'tiered-kv[sim]'"),
    "ray": ("ray", "pip install 'tiered-kv[ray]'"),
    "prometheus_client": ("prometheus-client", "pip install 'tiered-kv[metrics]'"),
    "torch": ("torch", "pip install 'tiered-kv[torch]', or your own CUDA build of torch (see docs/install.md)"),
}


def import_extra(module: str, purpose: str) -> ModuleType:
    """Import ``module`` for ``purpose``; raise :class:`MissingDependencyError` naming the fix if it fails.

    Args:
        module: A key of :data:`EXTRAS` (the top-level module name).
        purpose: What needs it, as the user would say it (``"simulate"``, ``"--plots"``).
    """
    dist, fix = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name in (module, None):
            raise MissingDependencyError(f"{purpose} needs {dist}, which is not installed: {fix}") from None
        detail = " ".join(str(exc).split())
        raise MissingDependencyError(
            f"{purpose} needs {dist}, which is installed but fails to import ({detail})"
        ) from None
