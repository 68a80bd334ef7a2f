"""The LMCache plug-in's page frame and settings, which need neither LMCache nor a medium.

The frame (``page_format``) says what object a page holds; the settings (``settings``)
read the plug-in's ``extra_config`` keys.  Both run in the default environment; the
plug-in itself is tested inside LMCache in ``test_integration_lmcache.py``.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.lmcache import page_format
from tiered_kv.integrations.lmcache.page_format import HEADER_BYTES, ObjectLayout, decode, encodable, encode
from tiered_kv.integrations.lmcache.settings import plugin_names, read_settings

CAP = 2048

FULL = ObjectLayout(1, ((2, 2, 16, 16),), (torch.float16,), CAP, False)
SHORT = ObjectLayout(1, ((2, 2, 5, 16),), (torch.float16,), 640, False)
GROUPS = ObjectLayout(1, ((2, 2, 4, 16), (1, 2, 4, 16)), (torch.float16, torch.float32), 1024, False)
NARROW = ObjectLayout(4, ((2, 2, 16, 16),), (torch.uint8,), 100, True)


@pytest.mark.parametrize("layout", [FULL, SHORT, GROUPS, NARROW], ids=["full", "short", "groups", "narrowed"])
def test_a_header_decodes_to_exactly_the_layout_it_encodes(layout):
    head = encode(layout)
    assert len(head) == HEADER_BYTES
    assert decode(head, CAP) == layout
    assert decode(head + b"payload", CAP) == layout  # only the header is read


def test_the_header_bytes_are_the_documented_layout():
    head = encode(SHORT)
    assert head[:16] == struct.pack("<4sBBBBQ", b"TKVL", 1, 1, 1, 0, 640)
    assert head[16:34] == bytes([0, 4]) + struct.pack("<4I", 2, 2, 5, 16)
    assert head[34:] == bytes(HEADER_BYTES - 34)


def corrupt(at: int, value: int) -> bytes:
    head = bytearray(encode(SHORT))
    head[at] = value
    return bytes(head)


@pytest.mark.parametrize(
    ("head", "capacity"),
    [
        (corrupt(0, ord("X")), CAP),  # magic
        (corrupt(4, 2), CAP),  # a future version
        (corrupt(6, 0), CAP),  # no groups
        (corrupt(7, 2), CAP),  # an unknown flag
        (corrupt(16, 200), CAP),  # an unknown dtype code
        (corrupt(17, 9), CAP),  # too many dims
        (corrupt(20, 3), CAP),  # a shape whose size is not the used bytes
        (corrupt(100, 1), CAP),  # garbage after the descriptors
        (encode(SHORT), 639),  # more data than the page holds
        (encode(SHORT)[:100], CAP),  # a truncated header
        (bytes(HEADER_BYTES), CAP),  # an all-zero page
    ],
)
def test_a_header_this_format_did_not_write_decodes_to_none(head, capacity):
    assert decode(head, capacity) is None


def test_encodable_names_what_a_page_cannot_hold():
    assert encodable(FULL, CAP) is None
    assert "2048 bytes of data (a page holds 2047)" in encodable(FULL, CAP - 1)
    assert "9 tensor groups" in encodable(ObjectLayout(1, ((1,),) * 9, (torch.uint8,) * 9, 9, False), CAP)
    assert "dtype torch.complex64" in encodable(ObjectLayout(1, ((2,),), (torch.complex64,), 16, False), CAP)
    assert "for shapes of 2048" in encodable(ObjectLayout(1, ((2, 2, 16, 16),), (torch.float16,), 100, False), CAP)


def test_dtype_codes_are_append_only():
    # Codes written to a medium name their dtype forever: the first ones must never move.
    assert page_format.DTYPE_NAMES[:10] == (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
    )


P = "storage_plugin.tkv."
TIER = {"type": "disk", "root": "/r", "capacity_bytes": 4096}


def test_the_plugin_finds_its_name_by_its_module_path_and_class_name():
    extra = {
        f"{P}module_path": "tiered_kv.integrations.lmcache",
        f"{P}class_name": "TieredKVStorage",
        "storage_plugin.other.module_path": "elsewhere",
        "storage_plugin.other.class_name": "TieredKVStorage",
    }
    mods = {"tiered_kv.integrations.lmcache"}
    assert plugin_names(extra, ["other", "tkv", "tkv"], mods, "TieredKVStorage") == ["tkv"]
    assert plugin_names(extra, None, mods, "TieredKVStorage") == []
    assert plugin_names(None, ["tkv"], mods, "TieredKVStorage") == []


def test_tiers_as_a_list_as_json_and_flattened_read_the_same():
    want = {"tiers": [TIER], "policy": "arc"}
    as_list = read_settings({f"{P}tiers": [TIER], f"{P}policy": "arc", f"{P}module_path": "m"}, "tkv")
    as_json = read_settings({f"{P}tiers": json.dumps([TIER]), f"{P}policy": "arc"}, "tkv")
    flat = read_settings({f"{P}tiers.0.{k}": v for k, v in TIER.items()} | {f"{P}policy": "arc"}, "tkv")
    assert as_list.store_config == as_json.store_config == flat.store_config == want
    assert (as_list.model, as_list.hash_scheme, as_list.put_workers, as_list.fault_hook) == (None, None, 2, None)


def test_other_plugins_keys_are_not_ours():
    s = read_settings({f"{P}tiers": [TIER], "storage_plugin.tkv2.colour": 1, "chunk_size": 3}, "tkv")
    assert s.store_config == {"tiers": [TIER]}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({f"{P}tiers": [TIER], f"{P}colour": 1}, "unknown extra_config key storage_plugin.tkv.colour"),
        ({}, "needs storage_plugin.tkv.tiers"),
        ({f"{P}tiers": "nope"}, "not JSON"),
        ({f"{P}tiers": []}, "non-empty list"),
        ({f"{P}tiers": [TIER], f"{P}tiers.0.type": "disk"}, "gives both"),
        ({f"{P}tiers.1.type": "disk"}, "indices must be 0..0"),
        ({f"{P}tiers.x.type": "disk"}, "tiers.<index>.<key>"),
        ({f"{P}tiers": [TIER], f"{P}model": ""}, "model must be a non-empty string"),
        ({f"{P}tiers": [TIER], f"{P}put_workers": True}, "put_workers must be a positive int"),
        ({f"{P}tiers": [TIER], f"{P}fault_hook": 3}, "fault_hook must be callable"),
    ],
)
def test_bad_settings_are_a_config_error_naming_the_key(extra, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("<", ".").replace(">", ".")):
        read_settings(extra, "tkv")
