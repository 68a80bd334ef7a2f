"""Imports point one way (DESIGN.md): a layer imports only the layers below it.

Within a layer, only these edges exist: transfer -> storage (the engines move
storage's bytes) and the manager -> the tiers (it drives the CPU store and the
chain of stores below it; the stores never import the manager).  The simulator
and the real engine are both drivers of the scheduler and never import each
other: the measurement rigs that compare them (``bench``: crossover, fidelity,
gpu-check) sit above both, and the command line (``cli``) above everything.
``errors`` and ``checks`` sit below every layer.
"""

import ast
import pathlib

import tiered_kv

LAYER = {
    "errors": -1,
    "checks": -1,
    "__init__": -1,
    "core": 0,
    "storage": 1,
    "transfer": 1,
    "manager": 2,
    "tiers": 2,
    "sched": 3,
    "obs": 3.5,  # reads the scheduler and the manager; the drivers (sim, engine) serve or write what it exports
    "sim": 4,
    "engine": 4,
    "demo": 5,
    "bench": 5,
    "cli": 6,
    "integrations": 6,  # adapters into other engines (vLLM): they use the layers below; nothing imports them
}
ALLOWED_SIDEWAYS = {
    ("transfer", "storage"),
    ("manager", "tiers"),
    ("__init__", "errors"),
    ("checks", "errors"),
}


def package_of(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0].removesuffix(".py")


def test_imports_point_down():
    root = pathlib.Path(tiered_kv.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        src_pkg = package_of(path, root)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tiered_kv."):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("tiered_kv.")]
            for name in names:
                dst_pkg = name.split(".")[1]
                if dst_pkg == src_pkg or (src_pkg, dst_pkg) in ALLOWED_SIDEWAYS:
                    continue
                if LAYER[dst_pkg] >= LAYER[src_pkg]:
                    bad.append(f"{path.relative_to(root)} imports {name}")
    assert bad == []


def test_core_and_transfer_plans_import_no_third_party_packages():
    root = pathlib.Path(tiered_kv.__file__).parent
    stdlib_only = [
        *root.glob("core/*.py"),
        root / "errors.py",
        root / "checks.py",
        *(root / "transfer" / n for n in ("plan.py", "engine.py", "controlled.py")),
        root / "storage" / "spec.py",
    ]
    for path in stdlib_only:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mod = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name) or ""
                assert mod.split(".")[0] not in {"torch", "numpy", "cupy", "yaml"}, f"{path} imports {mod}"


def test_the_tiers_import_nothing_of_the_manager():
    """The stores, their policies and the chain are the layer the manager drives; they never call up into it."""
    root = pathlib.Path(tiered_kv.__file__).parent
    bad = []
    for path in (root / "tiers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tiered_kv.manager"):
                bad.append(f"{path.relative_to(root)} imports {node.module}")
    assert bad == []


def test_the_tier_chain_and_the_stores_import_no_third_party_packages():
    """Only the I/O engines touch tensors (torch) and only the Redis modules the redis client."""
    root = pathlib.Path(tiered_kv.__file__).parent / "tiers"
    names = ("chain", "namespace", "block_format", "keyed_store", "io_handle", "disk_store", "redis_health")
    names += ("chunk_buffer",)
    names += ("store", "cpu_store", *(f"policies/{p}" for p in ("base", "lru", "arc", "factory")))
    for path in (root / f"{n}.py" for n in names):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mod = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name) or ""
                assert mod.split(".")[0] not in {"torch", "numpy", "redis", "yaml"}, f"{path} imports {mod}"
                assert not mod.startswith(("tiered_kv.storage.kv_storage", "tiered_kv.tiers.io_engine")), (
                    f"{path} imports {mod}, which needs torch"
                )


def _imported_modules(path: pathlib.Path) -> list[str]:
    mods = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.append(node.module)
        elif isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
    return mods


def test_nothing_imports_the_integrations_and_only_they_import_an_engine():
    """The engine adapters are optional extras: the package installs and runs without vLLM, SGLang or
    LMCache, so no module outside ``tiered_kv/integrations`` imports them, and none imports an engine itself."""
    root = pathlib.Path(tiered_kv.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        if package_of(path, root) == "integrations":
            continue
        for mod in _imported_modules(path):
            if mod.startswith("tiered_kv.integrations") or mod.split(".")[0] in ("vllm", "sglang", "lmcache"):
                bad.append(f"{path.relative_to(root)} imports {mod}")
    assert bad == []
    adapters = sorted(p.name for p in (root / "integrations" / "vllm").glob("*.py"))
    assert {"disk_tier.py", "redis_tier.py", "store_tier.py", "spec.py", "manager.py"} <= set(adapters)
    sglang = sorted(p.name for p in (root / "integrations" / "sglang").glob("*.py"))
    assert {"backend.py", "backend_config.py"} <= set(sglang)
