"""Helpers for the tiers below the CPU: a tiny KV geometry, a CPU staging tier, a real redis-server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.transfer.plan import TransferPlan

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)  # 512-byte blocks
NS = KVNamespace("tiny-llama", SPEC, "sha256/v1")
OTHER_NS = KVNamespace("other-model", SPEC, "sha256/v1")


def key(i: int) -> bytes:
    """A 32-byte block hash standing in for a SHA-256 chained hash."""
    return i.to_bytes(4, "big") * 8


def host(num_blocks: int = 9, layout: str = "block_contiguous", seed: int = 0) -> KVStorage:
    """A CPU tier filled with seeded random KV (NaN-free halves, so equality of tensors is byte equality)."""
    st = KVStorage(SPEC, num_blocks, "CPU", layout, device="cpu", pin=False)
    gen = torch.Generator().manual_seed(seed)
    st.kv.copy_(torch.randn(st.kv.shape, generator=gen).to(st.kv.dtype))
    return st


def block_bytes(st: KVStorage, block_id: int) -> bytes:
    """A block's bytes in canonical order (layer 0 K, layer 0 V, ...), whatever the layout."""
    return st.block(block_id).contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def plan(plan_id: int, src: str, dst: str, src_ids, dst_ids) -> TransferPlan:
    return TransferPlan(plan_id, src, dst, tuple(src_ids), tuple(dst_ids))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_redis_server() -> str:
    """The path of ``redis-server``; skips (or fails, where CI promises one) when it is missing."""
    path = shutil.which("redis-server")
    if path is None:
        if os.environ.get("TIERED_KV_REQUIRE_REDIS"):
            pytest.fail("TIERED_KV_REQUIRE_REDIS is set but redis-server is not installed")
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    return path


class RedisServer:
    """A real ``redis-server`` on a free localhost port, without persistence; stop() kills it."""

    def __init__(self) -> None:
        self.exe = need_redis_server()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
