"""``tiered-kv fidelity``: the simulator's prediction against the real engine on the same workload.

``tiered-kv fidelity --calibration FILE [CONFIG]`` simulates every run of the
config with the calibrated cost model, runs the same workload on the engine in
real time (arrivals on the wall clock, the workload's output tokens forced so
both see the same token sequences), and reports predicted against measured
throughput, swap (transfer) time and recompute time, with the relative error.

Importing this module imports neither torch nor the engine (``tiered-kv
--help`` works on a base install): the functions that run them import them.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.cli.flags import (
    add_calibration,
    add_config,
    add_json,
    add_no_progress,
    config_inputs,
    write_json,
)

if TYPE_CHECKING:
    from tiered_kv.sim.calibration import Calibration
    from tiered_kv.sim.config import RunSetup
    from tiered_kv.sim.progress import PhaseHook
    from tiered_kv.sim.workload import SimRequest

NAME = "fidelity"
SUMMARY = "compare the simulator's prediction with the real engine"
DESCRIPTION = (
    "Simulate every run of a config with a calibrated cost model, serve the same workload on the real "
    "engine in real time, and report predicted against measured throughput, transfer and recompute "
    "time.  Needs torch and the sim extra, and a calibration from `tiered-kv crossover`."
)
METRICS = ("throughput_rps", "transfer_s", "recompute_s")  # compared, run by run


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``fidelity``."""
    add_config(p, "a YAML config file or the name of a shipped config (default: fidelity-tiny)")
    add_calibration(
        p, "the calibration written by `tiered-kv crossover` (default: %(default)s)", Path("out/calibration.json")
    )
    add_json(p, "write predicted and measured rows (JSON) to this file")
    add_no_progress(p)


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a comparison reads: the config and what it names, and the calibration."""
    return config_inputs(args.config if args.config is not None else "fidelity-tiny", args.calibration)


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.calibration import load_calibration
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.progress import Phases

    import_extra("yaml", "this command")
    load_calibration(args.calibration)  # a missing or broken calibration fails before torch is even imported
    import_extra("torch", "this command")
    with Phases("fidelity", "halves", enabled=not args.no_progress) as phases:
        doc = fidelity(args.calibration, args.config, emit=phases.wrap(print), progress=phases)
    write_json(args.json, doc)
    return 0


def _token(t: int, vocab: int) -> int:
    """Workload ids are unbounded ranges; hash them into the model's vocabulary (equal stays equal)."""
    return (t * 2654435761) % vocab


def run_engine(st: RunSetup, workload: list[SimRequest], cal: Calibration) -> dict[str, Any]:
    """Serve ``workload`` on the real engine in real time; measure what the simulator predicts."""
    from tiered_kv.engine.engine import Engine
    from tiered_kv.engine.engine_config import EngineConfig
    from tiered_kv.engine.model import ModelConfig
    from tiered_kv.manager.manager_config import ManagerConfig
    from tiered_kv.sched.config import SchedulerConfig

    fields = {k: cal.model[k] for k in ModelConfig.__dataclass_fields__ if k in cal.model}
    config = ModelConfig(**fields)
    m, sc = st.manager, st.scheduler
    engine = Engine(
        config,
        EngineConfig(
            manager=ManagerConfig(  # the engine keeps its own defaults for the simulator's other settings
                num_gpu_blocks=m.num_gpu_blocks,
                num_cpu_blocks=m.num_cpu_blocks,
                block_size=m.block_size,
                offload=m.offload,
                hash_fn=m.hash_fn,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=sc.max_num_batched_tokens,
                max_num_seqs=sc.max_num_seqs,
                chunked_prefill=sc.chunked_prefill,
                victim_policy=sc.victim_policy,
                mode=sc.mode,
            ),
            layout=cal.layout,
        ),
        cost_model=st.cost_model,
    )
    vocab = config.vocab_size
    pending = deque(sorted(workload, key=lambda r: (r.arrival, r.rid)))
    finish: dict[int, float] = {}
    start = time.perf_counter()
    done_before = 0
    while pending or engine.scheduler.num_unfinished:
        now = time.perf_counter() - start
        while pending and pending[0].arrival <= now:
            r = pending.popleft()
            engine.add_request(
                r.rid,
                [_token(t, vocab) for t in r.prompt],
                len(r.output),
                forced_output=[_token(t, vocab) for t in r.output],
            )
        if engine.scheduler.num_unfinished:
            if not engine.step():
                raise RuntimeError("engine stalled")
        elif pending:
            time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - start)))
        if len(engine.outputs) != done_before:
            t = time.perf_counter() - start
            for rid in engine.outputs:
                finish.setdefault(rid, t)
            done_before = len(engine.outputs)
    engine.scheduler.drain(10)
    engine.close()
    counters = engine.metrics().counters
    makespan = max(finish.values())
    return {
        "throughput_rps": len(workload) / makespan,
        "transfer_s": engine.scheduler.copy_seconds,  # the copies' own durations, as their engine timed them
        "recompute_s": engine.stats.recompute_s,
        "makespan_s": makespan,
        "steps": engine.stats.steps,
        "wait_s": engine.stats.wait_s,
        "step_s": sum(dt for *_, dt, _c in engine.stats.step_log),
        "preemptions": counters.preemptions_swap + counters.preemptions_recompute,
    }


def fidelity(
    calibration: str | Path,
    config: str | Path | None = None,
    emit: Callable[[str], None] = print,
    progress: PhaseHook | None = None,
) -> dict[str, Any]:
    """Predict each run with the simulator and measure it on the engine; ``progress`` hears about each half."""
    from tiered_kv.sim.budget import build_workload
    from tiered_kv.sim.calibration import load_calibration
    from tiered_kv.sim.config import load_config, setup
    from tiered_kv.sim.simulator import Simulator

    cal = load_calibration(calibration)
    cfg = load_config(config or "fidelity-tiny", calibration=cal)
    setups = [setup(cfg, i, cal) for i in range(len(cfg["runs"]))]
    workload = build_workload(cfg, setups)
    phase, total = "simulating and serving each run", 2 * len(setups)
    if progress is not None:
        progress(phase, 0, total)
    rows = []
    emit(f"{'run':22} {'metric':15} {'predicted':>10} {'measured':>10} {'error':>7}")
    for i in range(len(cfg["runs"])):
        st = setups[i]
        pred = Simulator(st, workload).run()
        if progress is not None:
            progress(phase, 2 * i + 1, total)
        meas = run_engine(st, workload, cal)
        if progress is not None:
            progress(phase, 2 * i + 2, total)
        for m in METRICS:
            p, v = pred[m], meas[m]
            err = abs(p - v) / v if v else (0.0 if p == 0 else None)  # None: measured 0, predicted not
            rows.append({"run": st.name, "metric": m, "predicted": p, "measured": v, "error": err})
            shown = f"{err:7.1%}" if err is not None else "    n/a"
            emit(f"{st.name:22} {m:15} {p:10.3f} {v:10.3f} {shown}")
        rows.append(
            {
                "run": st.name,
                "metric": "preemptions",
                "predicted": pred["preemptions_swap"] + pred["preemptions_recompute"],
                "measured": meas["preemptions"],
                "error": None,
            }
        )
    errs = [r["error"] for r in rows if r["metric"] == "throughput_rps"]
    emit(f"\nthroughput error: mean {sum(errs) / len(errs):.1%}, max {max(errs):.1%} (goal: within 10%)")
    return {"calibration": str(calibration), "config": cfg["name"], "device": cal.device, "rows": rows}
