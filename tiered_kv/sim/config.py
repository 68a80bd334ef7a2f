"""Simulator configs: YAML, validated so that every error names its key.

Resolution adds the derived numbers (GPU/CPU blocks, link bandwidth, the
manager's cost model) and checks what one key alone cannot: a model whose
weights do not fit, a CPU tier larger than host memory, a swap run without a
CPU tier, or requests larger than the whole GPU KV pool.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.errors import ConfigError
from tiered_kv.manager.manager_config import ManagerConfig
from tiered_kv.manager.pricing import CostModel
from tiered_kv.sched.config import SchedulerConfig
from tiered_kv.sim.calibration import Calibration
from tiered_kv.sim.client import OPEN_LOOP, ClientSpec
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.config_schema import DEFAULT_RUNS, REGIME_SCHEMA, RUN_SCHEMA, SCHEMA
from tiered_kv.sim.engine_version import EngineVersion, parse_engine
from tiered_kv.sim.files import read_yaml
from tiered_kv.sim.kv_pool import vllm_kv_budget
from tiered_kv.sim.profiles import (
    UNCALIBRATED_FROM,
    HardwareProfile,
    LinkProfile,
    ModelProfile,
    check_pair,
    is_path_ref,
    load_hardware,
    load_model,
    uncalibrated_step,
)
from tiered_kv.sim.schema import validate
from tiered_kv.sim.shipped import shipped, shipped_names
from tiered_kv.sim.tier_config import NO_TIERS, TierSetup, resolve_tiers
from tiered_kv.sim.workload import check_load, longest_synthetic

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

GIB = 1 << 30
# The synthetic experiment, shipped in configs/ (the main job, scripts/run-main.sh, is mooncake-llama3-8b-h200).
DEFAULT_CONFIG = "oversubscribed-llama3-8b-h200"
__all__ = [
    "RunSetup",
    "config_from_raw",
    "derived_fields",
    "find_config",
    "input_files",
    "load_config",
    "read_config",
    "referenced_files",
    "resolve_paths",
    "setup",
    "validate_config",
]


@dataclass(frozen=True)
class RunSetup:
    """Everything one simulated run needs, derived from a validated config and one ``runs`` entry.

    The manager's and the scheduler's settings are theirs (:attr:`manager`, :attr:`scheduler`);
    the rest is the simulator's: the profiles and models that time the run, the copy mode, the
    tiers below the CPU, the client.
    """

    name: str
    hardware: HardwareProfile
    model: ModelProfile
    compute: ComputeModel
    link: LinkProfile
    manager: ManagerConfig  # what the run's TierManager is built with
    scheduler: SchedulerConfig
    cost_model: CostModel  # the manager's pricing of a swap against a recompute, from the profiles
    gpu_kv_gib: float
    cpu_kv_gib: float
    copies: str = "async"
    kv_layout: str = "block_contiguous"
    coalesce: bool = True
    note: str = ""
    vs: str | None = None
    tiers: TierSetup = NO_TIERS
    client: ClientSpec = OPEN_LOOP  # how the requests are sent (workload.concurrency, workload.think_s)
    engine: str = ""
    async_scheduling: bool = False
    # Not empty when the hardware profile gives no step model for the engine's era: what ran instead.
    uncalibrated: str = ""


def find_config(ref: str | Path | None) -> Path | Traversable:
    """The config file for ``ref``: a path, the name of a shipped config, or None for the synthetic experiment."""
    if ref is None:
        ref = DEFAULT_CONFIG
    p = Path(ref).expanduser()
    if p.exists():
        return p
    text = str(ref)
    if not text.endswith((".yaml", ".yml")) and "/" not in text:
        found = shipped("experiments", text)
        if found is not None:
            return found
    raise ConfigError(
        f"config file '{ref}' does not exist (give a path, or one of the shipped configs: "
        f"{', '.join(shipped_names('experiments'))})"
    )


def _under(base: Path, ref: str) -> str:
    p = Path(ref).expanduser()
    return str(p if p.is_absolute() else base / p)


def resolve_paths(raw: Any, base: Path) -> Any:
    """A copy of ``raw`` whose relative file references (profiles, trace) are made relative to ``base``.

    A config's paths mean what they say where the config lives, not where the
    command happens to run.
    """
    if not isinstance(raw, dict):
        return raw
    raw = copy.deepcopy(raw)
    for key in ("hardware", "model"):
        ref = raw.get(key)
        if isinstance(ref, str) and is_path_ref(ref):
            raw[key] = _under(base, ref)
    w = raw.get("workload")
    if isinstance(w, dict) and isinstance(w.get("trace"), str):
        w["trace"] = _under(base, w["trace"])
    return raw


def referenced_files(raw: Any, base: Path | None) -> list[Path]:
    """Every file a config's YAML refers to, at any depth: profile files, shipped profiles, traces.

    ``base`` is the config's directory (relative references are relative to it).
    These are the run's inputs, which no output of the run may overwrite.
    """
    out: list[Path] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        if not isinstance(node, dict):
            return
        for key, v in node.items():
            if isinstance(v, str) and key in ("hardware", "model", "trace"):
                if key == "trace" or is_path_ref(v):
                    p = Path(v).expanduser()
                    out.append(p if p.is_absolute() or base is None else base / p)
                else:
                    found = shipped("hardware" if key == "hardware" else "models", v)
                    if isinstance(found, Path):
                        out.append(found)
            else:
                walk(v)

    walk(raw)
    return out


def input_files(ref: str | Path | None) -> list[Path]:
    """The files a run of config ``ref`` reads: the config itself and everything it refers to."""
    src = find_config(ref)
    raw = read_yaml(src, "config")
    if not isinstance(src, Path):
        return referenced_files(raw, None)
    return [src, *referenced_files(raw, src.resolve().parent)]


def read_config(path: str | Path | None = None) -> tuple[Any, str]:
    """The raw YAML of a config (paths inside it resolved against its directory) and its name.

    An empty file (nothing, or only comments, or ``{}``) is refused: it would
    otherwise run every default.
    """
    src = find_config(path)
    raw = read_yaml(src, "config")
    if raw is None or raw == {}:  # an empty file is a mistake, never a request for the defaults
        raise ConfigError(
            f"config: '{src}' is empty; a config says what to simulate (see configs/quickstart-l40s.yaml), "
            "and `tiered-kv simulate` with no config runs the synthetic experiment"
        )
    if isinstance(src, Path):
        raw = resolve_paths(raw, src.resolve().parent)
    return raw, src.name.rsplit(".", 1)[0]


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    calibration: Calibration | None = None,
) -> dict[str, Any]:
    """Read and validate a YAML config (``None``: the synthetic experiment; a bare name: a shipped config).

    Relative paths inside the config (profile files, a trace) are resolved
    against the config file's directory.  With ``calibration``, runs are
    checked against the calibrated model rather than the config's model profile.
    """
    raw, stem = read_config(path)
    return config_from_raw(raw, stem, overrides, calibration)


def config_from_raw(
    raw: Any,
    stem: str = "experiment",
    overrides: dict[str, Any] | None = None,
    calibration: Calibration | None = None,
) -> dict[str, Any]:
    """Validate an already-read config, with dotted-key ``overrides`` applied first."""
    if overrides:
        raw = copy.deepcopy(raw or {})
        if not isinstance(raw, dict):
            raise ConfigError(f"config: expected a mapping, got {type(raw).__name__}")
        for dotted, value in overrides.items():
            node = raw
            *parents, leaf = dotted.split(".")
            for k in parents:
                if node.get(k) is None:  # absent, or an empty section in the YAML
                    node[k] = {}
                node = node[k]
                if not isinstance(node, dict):
                    raise ConfigError(f"{k}: expected a mapping, got {type(node).__name__} {node!r}")
            node[leaf] = value
    cfg = validate_config(raw, calibration)
    if cfg["name"] == "experiment":
        cfg["name"] = stem
    return cfg


def _check_length(spec: dict[str, Any], key: str) -> None:
    if spec["low"] > spec["high"]:
        raise ConfigError(f"{key}.low: must be <= {key}.high ({spec['high']}), got {spec['low']}")
    if spec["min"] > spec["max"]:
        raise ConfigError(f"{key}.min: must be <= {key}.max ({spec['max']}), got {spec['min']}")


def validate_config(raw: Any, calibration: Calibration | None = None) -> dict[str, Any]:
    cfg = validate(raw, SCHEMA)
    mem = cfg["memory"]
    if mem["cpu_kv_gib"] > mem["host_memory_gib"]:
        raise ConfigError(
            f"memory.cpu_kv_gib: {mem['cpu_kv_gib']} GiB exceeds memory.host_memory_gib ({mem['host_memory_gib']} GiB)"
        )
    w = cfg["workload"]
    window = w["trace_sample"]["window_s"]
    if window is not None and (
        len(window) != 2
        or any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in window)
        or not 0 <= window[0] < window[1]
    ):
        raise ConfigError(
            f"workload.trace_sample.window_s: must be [start, end] seconds with 0 <= start < end, got {window!r}"
        )
    if w["shared_prefix"] is not None and w["trace"] is not None:
        raise ConfigError("workload.shared_prefix: a workload is a trace or shared prefixes, not both (drop one)")
    _check_length(w["prompt_len"], "workload.prompt_len")
    _check_length(w["output_len"], "workload.output_len")
    check_load(w)
    runs = cfg["runs"] if cfg["runs"] is not None else copy.deepcopy(DEFAULT_RUNS)
    if not runs:
        raise ConfigError("runs: must list at least one run")
    cfg["runs"] = [validate(r, RUN_SCHEMA, f"runs[{i}]") for i, r in enumerate(runs)]
    names = [r["name"] for r in cfg["runs"]]
    if len(set(names)) != len(names):
        raise ConfigError(f"runs: run names must be unique, got {names}")
    for i, r in enumerate(cfg["runs"]):
        if r["vs"] is not None and r["vs"] not in names[:i]:
            raise ConfigError(f"runs[{i}].vs: must name a run listed before it (one of {names[:i]}), got {r['vs']!r}")
    if cfg["regimes"] is not None:
        if not cfg["regimes"]:
            raise ConfigError("regimes: must list at least one regime, or be left out")
        cfg["regimes"] = [validate(g, REGIME_SCHEMA, f"regimes[{i}]") for i, g in enumerate(cfg["regimes"])]
        rnames = [g["name"] for g in cfg["regimes"]]
        if len(set(rnames)) != len(rnames):
            raise ConfigError(f"regimes: regime names must be unique, got {rnames}")
    for key in ("gpu_kv_gib", "rate"):
        vals = cfg["sweep"][key]
        if vals is not None:
            for i, v in enumerate(vals):
                if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                    raise ConfigError(f"sweep.{key}[{i}]: must be a number > 0, got {v!r}")
                if not math.isfinite(v):
                    raise ConfigError(f"sweep.{key}[{i}]: must be a finite number, got {v!r}")
    for i in range(len(cfg["runs"])):
        setup(cfg, i, calibration)  # resolve every run now, so impossible values fail before any simulation
    return cfg


@dataclass(frozen=True, slots=True)
class _Sizes:
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu_kv_gib: float
    cpu_kv_gib: float
    block_bytes: int


def _sizes(
    cfg: dict[str, Any],
    run: dict[str, Any],
    rkey: str,
    hw: HardwareProfile,
    model: ModelProfile,
    limits: tuple[int, int],
    engine: EngineVersion,
) -> _Sizes:
    """The run's GPU and CPU pools in blocks and GiB, checked against the GPU, the host and the workload.

    Without ``memory.activation_reserve_gib`` the GPU's KV memory is what the engine's own memory
    profile leaves (:func:`~tiered_kv.sim.kv_pool.vllm_kv_budget`, for ``limits``:
    ``(max_num_batched_tokens, max_num_seqs)``).
    """
    mem = cfg["memory"]
    bs = mem["block_size"]
    weights = model.weight_bytes_per_gpu / GIB
    if mem["activation_reserve_gib"] is None:
        budget = vllm_kv_budget(
            hw, model, mem["gpu_memory_utilization"], limits[0], limits[1], engine, mem["cudagraph_gib"]
        )
        usable = budget.kv_gib + weights
        what = f"vLLM's memory profile: {budget.describe()}"
    else:
        usable = hw.memory_gib * mem["gpu_memory_utilization"] - mem["activation_reserve_gib"]
        what = f"memory.gpu_memory_utilization x {hw.memory_gib} GiB - memory.activation_reserve_gib"
    if weights >= usable:
        raise ConfigError(
            f"model: {model.name} needs {weights:.1f} GiB of weights per GPU but {hw.name} has only "
            f"{usable:.1f} GiB usable ({what})"
        )
    gpu_kv = run["gpu_kv_gib"] if run["gpu_kv_gib"] is not None else mem["gpu_kv_gib"]
    gkey = f"{rkey}.gpu_kv_gib" if run["gpu_kv_gib"] is not None else "memory.gpu_kv_gib"
    if gpu_kv is None:
        gpu_kv = usable - weights
    elif gpu_kv > usable - weights:
        raise ConfigError(
            f"{gkey}: {gpu_kv} GiB of KV does not fit next to {weights:.1f} GiB of weights in {usable:.1f} GiB"
        )
    cpu_kv = run["cpu_kv_gib"] if run["cpu_kv_gib"] is not None else mem["cpu_kv_gib"]
    ckey = f"{rkey}.cpu_kv_gib" if run["cpu_kv_gib"] is not None else "memory.cpu_kv_gib"
    if cpu_kv > mem["host_memory_gib"]:
        raise ConfigError(f"{ckey}: {cpu_kv} GiB exceeds memory.host_memory_gib ({mem['host_memory_gib']} GiB)")
    block_bytes = bs * model.kv_bytes_per_token
    # Explicit block counts (small experiments) win over sizes in GiB.
    if mem["gpu_blocks"] is not None and run["gpu_kv_gib"] is None:
        n_gpu, gkey = mem["gpu_blocks"], "memory.gpu_blocks"
        gpu_kv = n_gpu * block_bytes / GIB
    else:
        n_gpu = int(gpu_kv * GIB // block_bytes)
    tokens = run["cpu_kv_tokens"] if run["cpu_kv_tokens"] is not None else mem["cpu_kv_tokens"]
    if tokens is not None and run["cpu_kv_gib"] is None:
        ckey = f"{rkey}.cpu_kv_tokens" if run["cpu_kv_tokens"] is not None else "memory.cpu_kv_tokens"
        n_cpu = tokens // bs
        cpu_kv = n_cpu * block_bytes / GIB
        if cpu_kv > mem["host_memory_gib"]:
            raise ConfigError(
                f"{ckey}: {tokens} tokens of {model.name} KV ({cpu_kv:.1f} GiB) exceed memory.host_memory_gib "
                f"({mem['host_memory_gib']} GiB)"
            )
    elif mem["cpu_blocks"] is not None and run["cpu_kv_gib"] is None:
        n_cpu, ckey = mem["cpu_blocks"], "memory.cpu_blocks"
        cpu_kv = n_cpu * block_bytes / GIB
    else:
        n_cpu = int(cpu_kv * GIB // block_bytes)
    if n_gpu < 2:
        raise ConfigError(f"{gkey}: {gpu_kv} GiB holds fewer than 2 blocks of {block_bytes} bytes")
    if 0 < n_cpu < 2:
        raise ConfigError(f"{ckey}: {cpu_kv} GiB is non-zero but holds fewer than 2 blocks of {model.name} KV")
    if n_cpu == 0 and (run["mode"] == "swap" or run["offload"] != "none"):
        what = "mode: swap" if run["mode"] == "swap" else f"offload: {run['offload']}"
        raise ConfigError(f"{rkey}.{what.split(':')[0]}: {what} needs a CPU tier, but {ckey} is 0")
    w = cfg["workload"]
    if w["trace"] is None:
        longest = longest_synthetic(w)
        if -(-longest // bs) > n_gpu - 1:
            raise ConfigError(
                f"workload.prompt_len: the longest request ({longest} tokens) needs more than the "
                f"{n_gpu - 1} GPU blocks of {gkey}; it could never run"
            )
    return _Sizes(n_gpu, n_cpu, gpu_kv, cpu_kv, block_bytes)


def _models(
    cfg: dict[str, Any],
    run: dict[str, Any],
    hw: HardwareProfile,
    model: ModelProfile,
    calibration: Calibration | None,
    engine: EngineVersion,
) -> tuple[ComputeModel, CostModel, LinkProfile, str]:
    """The run's step-time model, the manager's cost model and the PCIe link: measured, or from the profiles.

    The step model is the hardware profile's for the engine's era; a profile that gives none for it
    runs with the uncalibrated default, and the fourth value then says so (else it is empty).
    """
    bs = cfg["memory"]["block_size"]
    c = cfg["compute"]
    if c["scheduler_steps"] > 1 and not engine.multi_step:
        raise ConfigError(
            f"compute.scheduler_steps: {engine.name} (the vLLM V1 engine) has no multi-step scheduling; "
            f"--num-scheduler-steps {c['scheduler_steps']} is vLLM 0.6's (say engine: vllm-0.6.0)"
        )
    sp = hw.step_for(engine.era)
    uncalibrated = ""
    if sp is None:
        sp = uncalibrated_step(engine.era)
        uncalibrated = (
            f"{hw.name} has no step model for {engine.era} ({engine.name}): running UNCALIBRATED, with the "
            f"{UNCALIBRATED_FROM} profile's (docs/hardware.md: calibrate with `tiered-kv calibrate`)"
        )
    mfu = c["mfu"] if c["mfu"] is not None else sp.mfu
    pre = c["prefill_mfu"] if c["prefill_mfu"] is not None else sp.prefill_mfu
    front = c["frontend_s"] if c["frontend_s"] is not None else sp.frontend_s
    eff = c["hbm_efficiency"] if c["hbm_efficiency"] is not None else sp.hbm_efficiency
    geometry_pieces = 2 * model.num_layers if run["kv_layout"] == "layer_first" else 1
    if calibration is not None:
        cost = calibration.cost_model
        compute = ComputeModel(
            hw, model, mfu, eff, 0.0, None, calibration.step_model, 0.0, pre, front, c["scheduler_steps"]
        )
        d2h, h2d, ovh = cost.d2h_bytes_per_s, cost.h2d_bytes_per_s, cost.per_copy_overhead_s
        link = LinkProfile(h2d, d2h, h2d + d2h, ovh)
    else:
        lk = cfg["link"]
        hl = hw.link
        # As in a profile, a D2H bandwidth left out is the H2D one (a symmetric link).
        one_way = lk["h2d_gbps"] is not None or lk["d2h_gbps"] is not None
        h2d = lk["h2d_gbps"] * 1e9 if lk["h2d_gbps"] is not None else hl.h2d_bytes_per_s
        d2h = (
            lk["d2h_gbps"] * 1e9
            if lk["d2h_gbps"] is not None
            else h2d
            if lk["h2d_gbps"] is not None
            else hl.d2h_bytes_per_s
        )
        if lk["bidir_gbps"] is not None:
            bidir = lk["bidir_gbps"] * 1e9
        elif one_way:  # a one-way override keeps the profile's ratio of total to one way
            ratio = hl.bidir_bytes_per_s / (hl.h2d_bytes_per_s + hl.d2h_bytes_per_s) if hl.h2d_bytes_per_s else 1.0
            bidir = (h2d + d2h) * min(ratio, 1.0)
        else:
            bidir = hl.bidir_bytes_per_s
        ovh = lk["per_copy_overhead_s"] if lk["per_copy_overhead_s"] is not None else hl.per_copy_overhead_s
        link = LinkProfile(h2d, d2h, bidir, ovh)
        step_s = c["step_overhead_s"] if c["step_overhead_s"] is not None else sp.step_overhead_s
        per_seq = c["per_seq_s"] if c["per_seq_s"] is not None else sp.per_seq_s
        per_layer = c["per_layer_s"] if c["per_layer_s"] is not None else sp.per_layer_s
        compute = ComputeModel(
            hw,
            model,
            mfu,
            eff,
            step_s,
            c["fixed_step_s"],
            None,
            per_seq,
            pre,
            front,
            c["scheduler_steps"],
            per_layer,
        )
        cost = CostModel(
            kv_bytes_per_token=model.kv_bytes_per_token,
            block_size=bs,
            d2h_bytes_per_s=d2h,
            h2d_bytes_per_s=h2d,
            # A run of blocks is one copy per layer and K/V in the layer-first layout.
            per_copy_overhead_s=ovh * geometry_pieces,
            prefill_tokens_per_s=compute.prefill_tokens_per_s(),
            prefill_quadratic_s_per_token2=compute.prefill_quadratic(),
        )
    return compute, cost, link, uncalibrated


def derived_fields(st: RunSetup) -> list[str]:
    """What a run's profiles derived rather than were given (``key = value (rule)``), for the run to print.

    A tier below the CPU whose medium the hardware profile does not describe is
    priced with the manager's measured link for that medium; that is listed too.
    """
    media = [
        f"hardware.tiers.{t.name} = the manager's measured {t.medium} link (the profile describes no {t.name})"
        for t in st.tiers.tiers
        if t.link.source == "default"
    ]
    return [*st.hardware.derived, *st.model.derived, *media]


def setup(cfg: dict[str, Any], run_index: int, calibration: Calibration | None = None) -> RunSetup:
    """Derive block counts, link and cost model for one run; raise ConfigError naming the key.

    With a ``calibration`` (from ``tiered-kv crossover``), the model, the link,
    the step-time model and the manager's cost model are the measured ones.
    """
    run = cfg["runs"][run_index]
    rkey = f"runs[{run_index}]"
    hw = load_hardware(cfg["hardware"])
    model = calibration.model_profile() if calibration is not None else load_model(cfg["model"])
    if calibration is not None and calibration.block_size != cfg["memory"]["block_size"]:
        raise ConfigError(
            f"memory.block_size: {cfg['memory']['block_size']} differs from the calibration's "
            f"block size {calibration.block_size}"
        )
    check_pair(hw, model)
    engine = parse_engine(cfg["engine"])
    s = cfg["scheduler"]
    seqs_default, tokens_default = hw.vllm_default_limits
    max_tokens = s["max_num_batched_tokens"] if s["max_num_batched_tokens"] is not None else tokens_default
    max_seqs = s["max_num_seqs"] if s["max_num_seqs"] is not None else min(seqs_default, max_tokens)
    sizes = _sizes(cfg, run, rkey, hw, model, (max_tokens, max_seqs), engine)
    n_gpu, n_cpu, block_bytes = sizes.num_gpu_blocks, sizes.num_cpu_blocks, sizes.block_bytes
    bs = cfg["memory"]["block_size"]
    compute, cost, link, uncalibrated = _models(cfg, run, hw, model, calibration, engine)
    async_sched = s["async_scheduling"] if s["async_scheduling"] is not None else engine.async_scheduling
    tiers = resolve_tiers(run["tiers"], hw.tiers, block_bytes, max(n_cpu, 0), run["offload"], f"{rkey}.tiers")
    _check_prefix_caching(cfg["memory"]["prefix_caching"], run, rkey)
    return RunSetup(
        name=run["name"],
        hardware=hw,
        model=model,
        compute=compute,
        link=link,
        manager=ManagerConfig(
            num_gpu_blocks=n_gpu,
            num_cpu_blocks=max(n_cpu, 0),
            block_size=bs,
            offload=run["offload"],
            hash_fn=cfg["hash"],
            enable_caching=cfg["memory"]["prefix_caching"],
            watermark=s["watermark"],
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_tokens,
            max_num_seqs=max_seqs,
            chunked_prefill=s["chunked_prefill"],
            victim_policy=run["victim_policy"],
            mode=run["mode"],
            scheduler_reserve_full_isl=s["scheduler_reserve_full_isl"],
        ),
        cost_model=cost,
        gpu_kv_gib=sizes.gpu_kv_gib,
        cpu_kv_gib=sizes.cpu_kv_gib,
        copies=run["copies"],
        kv_layout=run["kv_layout"],
        coalesce=run["coalesce"],
        note=run["note"],
        vs=run["vs"],
        tiers=tiers,
        client=ClientSpec(cfg["workload"]["concurrency"], cfg["workload"]["think_s"]),
        engine=engine.name,
        async_scheduling=async_sched,
        uncalibrated=uncalibrated if calibration is None else "",
    )


def _check_prefix_caching(on: bool, run: dict[str, Any], rkey: str) -> None:
    """A CPU prefix tier (offload, which tiers below the CPU need too) is keyed by block hash: it needs caching."""
    if not on and run["offload"] != "none":
        raise ConfigError(
            f"{rkey}.offload: {run['offload']} keeps a CPU prefix tier, which needs prefix caching, but "
            "memory.prefix_caching is false; give offload: none, or turn prefix caching on"
        )
