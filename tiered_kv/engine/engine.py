"""The real engine: the simulator's scheduler, the TierManager and a real copy engine over a real model.

Every step the scheduler picks a batch through the tier manager; the model
computes each scheduled request's tokens against its GPU block table; greedy
sampling produces the next token.  Preemptions are real swaps (bytes move
between the two ``KVStorage`` tiers through the copy engine) and real
recomputes.  When nothing can run because every runnable request waits on a
copy, the engine waits for that copy.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tiered_kv import checks
from tiered_kv.core.request import Request
from tiered_kv.engine.engine_config import EngineConfig
from tiered_kv.engine.model import ModelConfig, TinyLlama
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, TieredKVError
from tiered_kv.manager.metrics import MetricsSnapshot
from tiered_kv.manager.pricing import CostModel
from tiered_kv.manager.tier_manager import TierManager
from tiered_kv.sched import Scheduler, SchedulerOutput
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.stack import TierStack, check_tier_configs
from tiered_kv.tiers.tier_kind import TierConfig
from tiered_kv.transfer.event_handle import EventTransferHandle
from tiered_kv.transfer.factory import make_copy_engine
from tiered_kv.transfer.plan import TransferHandle
from tiered_kv.transfer.storage_engine import StorageEngineBase

if TYPE_CHECKING:
    from tiered_kv.obs.prometheus import MetricsServer


class EngineStalledError(TieredKVError, RuntimeError):
    """Requests wait, nothing can be scheduled and no copy is in flight: waiting would never end."""


@dataclass
class EngineStats:
    steps: int = 0
    compute_s: float = 0.0
    recompute_s: float = 0.0
    wait_s: float = 0.0
    wall_s: float = 0.0
    layer_wait_s: float = 0.0  # host time spent waiting for layers of layer-wise loads (CPU engines)
    # (tokens, attention units, KV tokens, requests, step seconds, of which model compute) per computing step
    step_log: list[tuple[int, float, float, int, float, float]] = field(default_factory=list)


class Engine:
    """A serving engine over a :class:`TinyLlama`.

    Args:
        model_config: The model (seeded random weights).
        config: Sizes, scheduling and options (:class:`EngineConfig`; default: its defaults).
        tiers: The tiers below the CPU tier, from the CPU down: a list of tier
            configurations (:class:`~tiered_kv.tiers.tier_kind.TierConfig`, e.g.
            ``[DiskTierConfig(path=...), RedisTierConfig(server="redis://...")]``), built by a
            :class:`~tiered_kv.tiers.stack.TierStack` (:attr:`tier_stack`) and
            closed by :meth:`close`.  They stage through the CPU tier.
        cost_model: For the cost-aware policy (e.g. from ``tiered-kv crossover``).
        copy_engine: Factory ``tiers -> engine``; default: CUDA streams on a GPU, else CPU threads.

    Raises:
        InvalidArgumentError: a bad tier list, or tiers without a CPU tier, before
            anything is allocated or opened; whatever fails later, nothing stays open.
    """

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        config: EngineConfig | None = None,
        *,
        tiers: Sequence[TierConfig] = (),
        cost_model: CostModel | None = None,
        copy_engine: Callable[[dict[str, KVStorage]], StorageEngineBase] | None = None,
    ) -> None:
        cfg = checks.instance("config", config if config is not None else EngineConfig(), EngineConfig)
        lower = check_tier_configs(tiers)
        mc = cfg.manager
        if lower and not mc.num_cpu_blocks:
            raise InvalidArgumentError("tiers below the CPU stage through the CPU tier: manager.num_cpu_blocks=0")
        self.engine_config: EngineConfig = cfg
        self.config = model_config or ModelConfig()
        self.device = device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        spec = self.config.kv_spec(mc.block_size)
        self.tiers = {
            "GPU": KVStorage(spec, mc.num_gpu_blocks, "GPU", cfg.layout, device=device),
            "CPU": KVStorage(spec, max(mc.num_cpu_blocks, 2), "CPU", cfg.layout),
        }
        self.copy = (copy_engine or make_copy_engine)(self.tiers)
        tm = self._make_manager(cfg, cost_model)
        self.scheduler = Scheduler(tm, cfg.scheduler)
        self.model = TinyLlama(self.config, device)
        self.outputs: dict[Hashable, list[int]] = {}
        self.logits: dict[Hashable, list[torch.Tensor]] = {}
        self.tables: dict[Hashable, list[list[int]]] = {}  # every distinct GPU table a request computed with
        self.record_logits = cfg.record_logits
        self.forced: dict[Hashable, list[int]] = {}
        self.stats = EngineStats()
        self.metrics_server: MetricsServer | None = None
        self.tier_stack: TierStack | None = None  # the tiers below the CPU, when there are any
        try:
            if lower:
                self.tier_stack = self._attach_tiers(tm, str(mc.hash_fn), lower)
            if cfg.metrics_port is not None:
                self.serve_metrics(cfg.metrics_port)
        except BaseException:
            self.close()
            raise

    def _make_manager(self, cfg: EngineConfig, cost_model: CostModel | None) -> TierManager:
        """The tier manager over the two tiers and the copy engine.

        Without ``cost_model``, nominal prices: 10 GB/s each way and 20k prefill tokens/s.
        """
        spec = self.tiers["GPU"].spec
        cm = cost_model or CostModel(
            kv_bytes_per_token=spec.bytes_per_token,
            block_size=cfg.manager.block_size,
            d2h_bytes_per_s=10e9,
            h2d_bytes_per_s=10e9,
            prefill_tokens_per_s=20_000.0,
        )
        return TierManager(cfg.manager, self.copy, kv_spec=spec, cost_model=cm)

    def _attach_tiers(self, tm: TierManager, hash_fn: str, tiers: list[TierConfig]) -> TierStack:
        """Build the tiers below the CPU tier and hand them to the manager; on failure close what was built."""
        cpu = self.tiers["CPU"]
        stack = TierStack(tm.store, cpu, KVNamespace(self.model_id, cpu.spec, f"{hash_fn}/v1/seed=0"), tiers)
        try:
            tm.attach_tiers(list(stack.entries))
        except BaseException:
            stack.close()
            raise
        return stack

    def add_request(
        self, request_id: Hashable, prompt: Sequence[int], max_tokens: int, forced_output: Sequence[int] | None = None
    ) -> Request:
        """Queue a request.  ``forced_output`` replays given tokens instead of sampling (for timing studies)."""
        req = Request(request_id, prompt, max_tokens=max_tokens)
        self.scheduler.add_request(req)
        if forced_output is not None:
            self.forced[request_id] = list(forced_output)
        return req

    def _finished(self, req: Request) -> None:
        self.outputs[req.request_id] = req.output_token_ids

    def step(self) -> bool:
        """Run one scheduling step; False when there is nothing left to do.

        When nothing can run because every request's KV is still arriving, it
        waits for a copy.  When nothing can run and no copy is in flight, it
        raises :class:`EngineStalledError` instead of spinning.
        """
        sched = self.scheduler
        t_step = time.perf_counter()
        out = sched.schedule()
        if not out.scheduled:
            return self._idle_step()
        t0 = time.perf_counter()
        sampled, attn, ctx = self._compute(out)
        if self.device.startswith("cuda"):
            torch.cuda.current_stream().synchronize()  # engine step boundary (host needs the tokens)
        tokens = {rid: int(t) for rid, t in sampled.items()}
        compute = time.perf_counter() - t0
        self.stats.compute_s += compute
        self.stats.steps += 1
        for req in sched.update(out, tokens):
            self._finished(req)
        dt = time.perf_counter() - t_step  # the whole step: scheduling, manager, model, bookkeeping
        self.stats.step_log.append((out.num_tokens, attn, ctx, len(out.scheduled), dt, compute))
        if out.recomputed_tokens:
            self.stats.recompute_s += dt * out.recomputed_tokens / out.num_tokens
        self._publish_metrics()
        return True

    def _idle_step(self) -> bool:
        """A step with nothing scheduled: wait for a copy in flight, or end, or raise when nothing can ever run."""
        sched = self.scheduler
        if sched.copies_in_flight():
            t0 = time.perf_counter()
            sched.tm.wait(5.0)  # the next step settles what landed
            self.stats.wait_s += time.perf_counter() - t0
            self._publish_metrics()
            return True
        if sched.num_unfinished:
            raise EngineStalledError(
                f"engine stalled: {sched.num_unfinished} requests unfinished ({len(sched.waiting)} waiting, "
                f"{len(sched.running)} running, {len(sched.swapped)} swapped), nothing schedulable and no "
                "copy in flight; the GPU pool may be too small for the longest request"
            )
        self._publish_metrics()
        return False

    def _compute(self, out: SchedulerOutput) -> tuple[dict[Hashable, Any], float, int]:
        """Run the model over every scheduled chunk; return the sampled tokens, attention units and KV tokens.

        Sampled tokens are ints, or device scalars until the step's one sync (in :meth:`step`).
        """
        sched = self.scheduler
        sampled: dict[Hashable, Any] = {}
        kv = self.tiers["GPU"]
        attn = 0.0
        ctx = 0
        for req, n in out.scheduled:
            rid = req.request_id
            c = req.num_computed_tokens
            table = sched.tm.gpu_block_ids(rid)
            self._record_table(rid, table)
            load = out.loads.get(rid)
            wait = None if load is None else (lambda i, h=load: self._wait_layer(h, i))
            save = out.saves.get(rid)
            opened = None if save is None else (lambda i, h=save: self.copy.open_layer(h, i))
            logits = self.model.forward_chunk(
                req.all_token_ids[c : c + n], c, table, kv, before_layer=wait, after_layer=opened
            )
            if logits is None:
                continue  # its load failed: update() discards its step
            if c + n == req.num_tokens:
                forced = self.forced.get(rid)
                # Argmax stays on the device until the step's one sync.
                sampled[rid] = forced[req.num_output_tokens] if forced else logits[-1].argmax()
                if self.record_logits:
                    self.logits.setdefault(rid, []).append(logits[-1].clone())
            attn += (c + n) * (c + n) - c * c
            ctx += c + n
        return sampled, attn, ctx

    def _record_table(self, rid: Hashable, table: list[int]) -> None:
        """Keep ``table`` in the request's history: a new entry when it is not an extension of the last one."""
        hist = self.tables.setdefault(rid, [])
        if not hist or hist[-1] != table[: len(hist[-1])]:
            hist.append(list(table))
        else:
            hist[-1] = list(table)

    def _wait_layer(self, handle: TransferHandle, layer: int) -> bool:
        """Before layer ``layer`` of a request whose KV is landing: order compute after that layer's copy."""
        if handle.done() and not handle.ok:
            return False
        if isinstance(handle, EventTransferHandle) and handle.event is not None:
            self.copy.make_compute_wait(handle, layer=layer)  # type: ignore[attr-defined]
            return True  # the device waits; the host goes on issuing the layers before
        t0 = time.perf_counter()
        ok = handle.wait_layer(layer)
        self.stats.layer_wait_s += time.perf_counter() - t0
        return ok

    def run(self, max_steps: int = 1_000_000) -> dict[Hashable, list[int]]:
        """Step until every request finished, then let copies in flight land; return the tokens per request."""
        t0 = time.perf_counter()
        for _ in range(max_steps):
            if not self.step():
                break
        self.scheduler.drain(10)
        self.stats.wall_s += time.perf_counter() - t0
        self._publish_metrics()
        return self.outputs

    def metrics(self) -> MetricsSnapshot:
        """The tier manager's counters and gauges."""
        return self.scheduler.tm.metrics()

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Serve Prometheus metrics (``docs/metrics.md``) at ``http://host:port/metrics`` until :meth:`close`.

        Port 0 picks a free port.  Scrapes see the state at the end of the
        last step (or of :meth:`run`), never a half-done step.  Needs the
        metrics extra (``pip install 'tiered-kv[metrics]'``).  Returns the URL.
        """
        from tiered_kv.obs.prometheus import MetricsServer

        if self.metrics_server is not None:
            raise InvalidTransitionError(f"metrics are already served at {self.metrics_server.url}")
        self.metrics_server = MetricsServer(self.scheduler, port, host)
        return self.metrics_server.url

    def _publish_metrics(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.publish()

    @property
    def model_id(self) -> str:
        """The model's name in a tier's namespace: its config decides its weights, so a digest of it."""
        return f"tinyllama-{hashlib.blake2b(repr(self.config).encode(), digest_size=8).hexdigest()}"

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.tier_stack is not None:
            self.tier_stack.close()  # its I/O engines finish what is queued, then the disk is released
        if hasattr(self.copy, "close"):
            self.copy.close()
