#!/usr/bin/env bash
# Build the package with its core compiled by mypyc (TIERED_KV_MYPYC=1, see setup.py) and
# install it, without dependencies, into build/compiled: a tree that PYTHONPATH puts in
# front of the editable checkout.  scripts/test.sh runs the core tests against it.
# Rebuilt only when a source changes.  Prints the tree's path if the core compiled; prints
# nothing when no C compiler could build it (the wheel is then pure Python).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/compiled
stamp=$( (cat setup.py pyproject.toml; find tiered_kv -name '*.py' -print0 | sort -z | xargs -0 cat) | sha256sum | cut -d' ' -f1)
if [ ! -f "$out/.stamp" ] || [ "$(cat "$out/.stamp")" != "$stamp" ]; then
    rm -rf build/compiled build/compiled-src build/compiled-wheel
    mkdir -p build/compiled-src
    # Build from a copy: setuptools' build/ and egg-info then never mix with the checkout.
    cp -a pyproject.toml setup.py README.md configs build/compiled-src/
    tar -cf - --exclude=__pycache__ --exclude='*.so' tiered_kv | tar -xf - -C build/compiled-src
    (cd build/compiled-src && TIERED_KV_MYPYC=1 ../../.venv/bin/pip wheel -q --no-deps --no-build-isolation \
        --disable-pip-version-check -w ../compiled-wheel .)
    .venv/bin/pip install -q --no-deps --disable-pip-version-check --target "$out" build/compiled-wheel/*.whl
    echo "$stamp" > "$out/.stamp"
fi
if (cd "$out" && ../../.venv/bin/python -c "import tiered_kv.core as c, sys; sys.exit(0 if c.COMPILED else 1)"); then
    echo "$out"
fi
