"""The package's own kinds of tier below the CPU, one module per kind, named by its ``type``.

:func:`~tiered_kv.tiers.tier_kind.find_tier_kind` imports ``kinds.<type>`` the first
time a config names that type; nothing else lists them.
"""
