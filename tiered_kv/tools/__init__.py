"""Measurement tools behind the ``tiered-kv`` subcommands (layer 4: may import every layer)."""
