"""Transfer benchmark; the same as ``tiered-kv bench-transfer`` (see tiered_kv/tools/bench_transfer.py)."""

import sys

from tiered_kv.tools.bench_transfer import main

if __name__ == "__main__":
    sys.exit(main())
