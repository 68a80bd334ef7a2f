"""The bookkeeping core must run where torch is absent."""

import subprocess
import sys


def test_importing_core_loads_no_torch():
    code = (
        "import sys, tiered_kv, tiered_kv.core, tiered_kv.core.kv_cache_manager, tiered_kv.demo;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'cupy')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"core imported heavy modules: {proc.stdout} {proc.stderr}"


def test_core_sources_do_not_mention_torch_imports():
    import pathlib

    import tiered_kv.core

    root = pathlib.Path(tiered_kv.core.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path
