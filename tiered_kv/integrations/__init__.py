"""Adapters that run tiered_kv's parts inside other serving engines.

Each adapter is an optional extra, imported only when its own module is: nothing
else in the package imports this subpackage, so tiered_kv installs and runs
without any of the engines it adapts to.
"""
