"""``python -m tiered_kv.cli``: the ``tiered-kv`` command without the console script (a checkout on PYTHONPATH)."""

import sys

from tiered_kv.cli import main

sys.exit(main())
