"""Transfer benchmark; the same as ``tiered-kv bench-transfer`` (see tiered_kv/bench/transfer.py)."""

import sys

from tiered_kv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-transfer", *sys.argv[1:]]))
