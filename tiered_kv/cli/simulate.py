"""``tiered-kv simulate``: every run of a config, in every regime, on one workload per regime.

A config's ``regimes:`` (optional) lists arrival rates to run the whole set of
runs at; the report says, from the measurements, whether each is below
capacity (latency is service time) or overloaded (latency is queueing).
Runs are independent simulations: with ``workers > 1`` they run in worker
processes, and the results are the same, byte for byte, as in one process.

The flags import nothing heavy (``tiered-kv --help`` works on a base install);
the simulator is imported by the functions that run it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.cli.flags import (
    add_calibration,
    add_config,
    add_json,
    add_no_progress,
    add_plots,
    add_workers,
    config_inputs,
    need_extras,
)
from tiered_kv.cli.outputs import add_output

if TYPE_CHECKING:
    from tiered_kv.obs.recorder import Reading
    from tiered_kv.sim.calibration import Calibration
    from tiered_kv.sim.config import RunSetup
    from tiered_kv.sim.progress import Progress
    from tiered_kv.sim.workload import SimRequest

Done = Callable[[int, Any], None]

NAME = "simulate"
SUMMARY = "simulate every run of a config on one workload"
DESCRIPTION = (
    "Simulate every entry of a config's `runs:` on one workload with the real tier manager "
    "and scheduler, then print a comparison table.  No output may be an input of the run (the config, "
    "its profiles, the workload trace, the calibration), and every output is created before the first "
    "step.  Needs the sim extra."
)


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``simulate`` (imports nothing heavy: ``--help`` works on a base install)."""
    add_config(
        p,
        "a YAML config file, or the name of a shipped config such as fidelity-tiny "
        "(default: oversubscribed-llama3-8b-h200, the synthetic experiment; the main job is mooncake-llama3-8b-h200)",
    )
    add_json(p, "write the results document (JSON) to this file")
    add_plots(p, "write PNG plots into this directory")
    add_calibration(p, "simulate with the cost model measured by `tiered-kv crossover` (a calibration JSON file)")
    add_output(
        p,
        "--metrics",
        metavar="PATH",
        help="write every run's metrics as a Prometheus text exposition (label run=NAME) to this file; "
        "needs the metrics extra",
    )
    add_output(
        p,
        "--requests",
        metavar="PATH",
        help="write one JSONL row per request and run (arrival, first token, finish, preemptions, swap bytes, "
        "recomputed tokens); rows join back to a replayed trace by id",
    )
    add_output(
        p,
        "--timeline",
        metavar="PATH",
        help="write a timeline of the runs (Chrome/Perfetto JSON): compute steps and each copy on its own track, "
        "both directions",
    )
    p.add_argument("--trace", action=_Renamed, nargs="?", help=argparse.SUPPRESS)
    add_workers(p, "simulate the runs in N processes on this machine (default: 1; the results are the same)")
    add_no_progress(p)


class _Renamed(argparse.Action):
    """``--trace`` was the timeline's old name; a workload trace is an input, so the flag now says what it writes."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error("--trace is now --timeline (it writes a timeline of the run; the workload trace is an input)")


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a run reads: the config, its profiles and trace, and the calibration."""
    return config_inputs(args.config, args.calibration)


def run(args: argparse.Namespace) -> int:
    """Simulate; the outputs were already checked against the inputs and created (``outputs.claim_outputs``)."""
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    need_extras(
        (args.metrics, "prometheus_client", "--metrics"),
        (args.plots, "matplotlib", "--plots"),
    )
    simulate(
        args.config,
        args.json,
        args.plots,
        progress=not args.no_progress,
        calibration=args.calibration,
        requests_path=args.requests,
        metrics_path=args.metrics,
        timeline_path=args.timeline,
        workers=args.workers,
    )
    return 0


@dataclass(frozen=True)
class Task:
    """One simulation: a run of a validated config (one regime's) and what to keep of it."""

    cfg: dict[str, Any]
    regime: str | None
    run_index: int
    calibration: Calibration | None
    keep_requests: bool
    keep_timeline: bool
    pid: int = 1
    keep_metrics: bool = False


def run_task(
    task: Task, hook: Callable[[int, int, float], None] | None = None, workload: list[SimRequest] | None = None
) -> dict[str, Any]:
    """Simulate one task (in this process or a worker); returns its results, plus rows and timeline if asked.

    ``workload`` is the task's config's workload when the caller has it already (the same
    seed always generates the same one); a worker process generates its own.
    """
    from tiered_kv.obs.recorder import MetricsRecorder
    from tiered_kv.sim.config import setup
    from tiered_kv.sim.records import jsonl
    from tiered_kv.sim.simulator import Simulator
    from tiered_kv.sim.timeline import chrome_trace
    from tiered_kv.sim.workload import generate

    st = setup(task.cfg, task.run_index, task.calibration)
    if workload is None:
        workload = generate(task.cfg["workload"], task.cfg["seed"])
    t0 = time.perf_counter()
    sim = Simulator(st, workload, progress=hook, keep_timeline=task.keep_timeline)
    recorder = MetricsRecorder(sim.scheduler) if task.keep_metrics else None
    res = sim.run()
    res["wall_s"] = time.perf_counter() - t0
    res["regime"] = task.regime
    res["note"] = st.note
    res["vs"] = st.vs
    extra: dict[str, Any] = {}
    if task.keep_requests:
        extra["requests"] = jsonl(sim.records.values(), {"run": st.name, "regime": task.regime})
    if task.keep_timeline:
        extra["timeline"] = chrome_trace(sim, f"{task.regime + ': ' if task.regime else ''}{st.name}", task.pid)
    if recorder is not None:
        labels = {"run": st.name, **({"regime": task.regime} if task.regime else {})}
        extra["metrics"] = (labels, recorder.read())
    return {"result": res, **extra}


def regime_configs(raw: Any, stem: str, overrides: dict[str, Any] | None, cal: Calibration | None) -> list[tuple]:
    """``(name, offered rate, expected regime, validated config)`` per regime (one, unnamed, without ``regimes``)."""
    from tiered_kv.sim.config import config_from_raw

    base = config_from_raw(raw, stem, overrides, cal)
    if base["regimes"] is None:
        return [(None, base["workload"]["arrival"]["rate"], None, base)]
    out = []
    for g in base["regimes"]:
        changes = dict(overrides or {})
        changes["workload.arrival.rate"] = g["rate"]
        if g["num_requests"] is not None:
            changes["workload.num_requests"] = g["num_requests"]
        out.append((g["name"], g["rate"], g["expect"], config_from_raw(raw, stem, changes, cal)))
    return out


def _serial(
    tasks: list[Task],
    prog: Progress,
    sizes: list[int],
    say: Callable[[str], None],
    workloads: dict[str | None, list[SimRequest]],
) -> list[dict]:
    outs = []
    done_before = 0
    for task, n in zip(tasks, sizes, strict=True):
        name = task.cfg["runs"][task.run_index]["name"]
        label = f"{task.regime}: {name}" if task.regime else name

        def hook(done: int, total: int, sim_t: float, base: int = done_before, label: str = label) -> None:
            prog.update(base + done, f"{label}, simulated {sim_t:.0f} s")

        out = run_task(task, hook, workloads[task.regime])
        res = out["result"]
        say(
            f"  {label}: {res['makespan_s']:.1f} simulated s in {res['wall_s']:.1f} wall s "
            f"({n / res['wall_s']:.0f} requests/s)"
        )
        outs.append(out)
        done_before += n
    return outs


def _parallel(tasks: list[Task], workers: int, prog: Progress, sizes: list[int], say: Callable[[str], None]) -> list:
    def done(k: int, out: dict[str, Any]) -> None:
        res = out["result"]
        label = f"{tasks[k].regime}: {res['run']}" if tasks[k].regime else res["run"]
        say(f"  {label}: {res['makespan_s']:.1f} simulated s in {res['wall_s']:.1f} wall s")
        prog.advance(sizes[k], label)

    return in_processes(run_task, tasks, workers, done, "simulate")


def in_processes(fn: Callable[[Any], Any], items: Sequence[Any], workers: int, done: Done, command: str) -> list[Any]:
    """``fn(item)`` for every item in up to ``workers`` spawned processes; the results in item order.

    ``done(k, result)`` hears of each item as it finishes (for progress).  Any error
    cancels what has not started; a worker that dies (killed for memory) is a
    :class:`~tiered_kv.sim.simulator.SimulationError` naming the likely fix.
    """
    from tiered_kv.sim.simulator import SimulationError

    # spawn, not fork: a forked child would inherit the progress thread's locks mid-use.
    ctx = multiprocessing.get_context("spawn")
    outs: list[Any] = [None] * len(items)
    with ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=ctx) as pool:
        futures = {pool.submit(fn, item): k for k, item in enumerate(items)}
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    k = futures[f]
                    outs[k] = f.result()
                    done(k, outs[k])
        except BrokenProcessPool:
            raise SimulationError(f"a {command} worker process died (out of memory? try fewer --workers)") from None
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return outs


def _plan(
    regimes: list[tuple],
    cal: Calibration | None,
    requests_path: Path | None,
    timeline_path: Path | None,
    metrics_path: Path | None,
) -> tuple[list[Task], list[int], dict[str | None, list[SimRequest]], list[RunSetup]]:
    """One task per run and regime, each regime's workload built once; and the first regime's run setups."""
    from tiered_kv.sim.budget import build_workload
    from tiered_kv.sim.config import setup

    tasks: list[Task] = []
    sizes: list[int] = []
    workloads: dict[str | None, list[SimRequest]] = {}
    setups0: list[RunSetup] = []
    for name, _rate, _expect, cfg in regimes:
        setups = [setup(cfg, i, cal) for i in range(len(cfg["runs"]))]
        workload = workloads[name] = build_workload(cfg, setups)  # sized and checked once per regime
        setups0 = setups0 or setups
        for i in range(len(setups)):
            keep = (requests_path is not None, timeline_path is not None)
            tasks.append(Task(cfg, name, i, cal, *keep, len(tasks) + 1, metrics_path is not None))
            sizes.append(len(workload))
    return tasks, sizes, workloads, setups0


def _report_regimes(
    regimes: list[tuple], results: list[dict[str, Any]], emit: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Print each regime's verdict and tables; return the regime summaries of the results document.

    The legends are printed under the first regime's tables only: the others' columns are the same.
    """
    from tiered_kv.sim import run_tables
    from tiered_kv.sim.report import regime_verdict

    summaries = []
    for k, (name, rate, expect, _) in enumerate(regimes):
        runs = [r for r in results if r["regime"] == name]
        verdict = regime_verdict(runs, rate)
        summaries.append({"name": name, "rate": rate, "expect": expect, **verdict})
        emit("")
        if name is not None:
            emit(f"regime {name}: {rate:g} requests/s offered; {verdict['text']}")
            if expect is not None and expect != verdict["regime"]:
                emit(f"  note: this regime was meant to be {expect!r}, but the measurements say {verdict['regime']!r}")
        emit(run_tables.report(runs, legend=k == 0))
    return summaries


def _write_outputs(
    doc: dict[str, Any],
    outs: list[dict[str, Any]],
    emit: Callable[[str], None],
    json_path: Path | None,
    requests_path: Path | None,
    timeline_path: Path | None,
    metrics_path: Path | None,
    plots_dir: Path | None,
) -> None:
    """Write every output the caller asked for, and say where."""
    from tiered_kv.sim.files import write_text
    from tiered_kv.sim.report import plot, write_json

    results = doc["runs"]
    cfg0 = doc["config"]
    if json_path is not None:
        write_json(json_path, doc)
        emit(f"\nwrote {json_path}")
    if requests_path is not None:
        write_text(requests_path, "".join(o["requests"] for o in outs), "--requests")
        emit(f"wrote {requests_path}")
    if timeline_path is not None:
        write_timeline(timeline_path, [e for o in outs for e in o["timeline"]])  # each run is a process of its own
        emit(f"wrote {timeline_path}")
    if metrics_path is not None:
        write_metrics(metrics_path, [o["metrics"] for o in outs])
        emit(f"wrote {metrics_path}")
    if plots_dir is not None:
        for p in plot(results, plots_dir, cfg0["name"]):
            emit(f"wrote {p}")


def simulate(
    config: str | Path | None = None,
    json_path: Path | None = None,
    plots_dir: Path | None = None,
    overrides: dict[str, Any] | None = None,
    emit: Callable[[str], None] = print,
    progress: bool = True,
    calibration: Path | None = None,
    requests_path: Path | None = None,
    timeline_path: Path | None = None,
    workers: int = 1,
    metrics_path: Path | None = None,
) -> dict[str, Any]:
    """Run every ``runs`` entry of a config, in every regime; return the results document.

    ``config`` is a path, the name of a shipped config, or None for the main
    experiment.  With ``calibration`` (from ``tiered-kv crossover``) the
    measured model, link and step times replace the config's hardware and
    model profiles.  The workload's memory and time are estimated first, and a
    config that could not finish on this machine is refused before anything
    runs.  ``requests_path`` gets one JSONL row per request and run;
    ``timeline_path`` a timeline (Chrome/Perfetto JSON) of every step and copy;
    ``metrics_path`` the Prometheus text exposition of every run (labels
    ``run`` and ``regime``; ``docs/metrics.md``).
    """
    from tiered_kv.sim import trace_formats, trace_report
    from tiered_kv.sim.calibration import load_calibration
    from tiered_kv.sim.client import describe_load
    from tiered_kv.sim.config import derived_fields, read_config
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.progress import Progress
    from tiered_kv.sim.report import fit_lines, kv_demand

    emit = fit_lines(emit)  # every line within 100 columns: prose is wrapped (the tables are narrow)
    cal = load_calibration(calibration) if calibration is not None else None
    raw, stem = read_config(config)
    regimes = regime_configs(raw, stem, overrides, cal)
    if plots_dir is not None:
        import_extra("matplotlib", "--plots")  # before the run, not after it
    if metrics_path is not None:
        import_extra("prometheus_client", "--metrics")
    tasks, sizes, workloads, setups0 = _plan(regimes, cal, requests_path, timeline_path, metrics_path)
    cfg0 = regimes[0][3]
    first = setups0[0]
    demand0 = kv_demand(first, workloads[regimes[0][0]])
    where = f"{cal.device} (calibrated)" if cal is not None else first.hardware.name
    if first.uncalibrated:  # the first line a run prints: its step times are a default, not this GPU's
        emit(f"note: {first.uncalibrated}")
    load = describe_load(cfg0["workload"])  # first, where it is seen: it changes every number below
    m, sc = first.manager, first.scheduler
    emit(
        f"{cfg0['name']}{f', load: {load};' if load else ':'} {first.model.name} on {where}, GPU KV "
        f"{first.gpu_kv_gib:.4g} GiB ({m.num_gpu_blocks} blocks of {m.block_size} tokens), up to "
        f"{sc.max_num_seqs} running requests and {sc.max_num_batched_tokens} tokens a step; "
        f"{demand0.describe(sc.max_num_seqs)}"
    )
    w = cfg0["workload"]
    if w["trace"] is not None:
        trace = trace_formats.read(Path(w["trace"]), w["trace_format"], w["arrival"]["rate"])
        kept = len(workloads[regimes[0][0]])
        sampled = f", {kept} of them replayed ({w['trace_sample']})" if kept != len(trace.rows) else ""
        skipped = f"; skipped {trace.skipped_text()}" if trace.skipped else ""
        emit(f"trace {w['trace']} ({w['trace_format']}): {len(trace.rows)} requests{sampled}{skipped}")
    derived = list(dict.fromkeys(d for st in setups0 for d in derived_fields(st)))
    if derived:
        emit(f"derived, not given in the profiles: {'; '.join(derived)}")
    with Progress("simulate", sum(sizes), "requests", enabled=progress) as prog:
        say = prog.wrap(emit)
        if workers > 1 and len(tasks) > 1:
            outs = _parallel(tasks, workers, prog, sizes, say)
        else:
            outs = _serial(tasks, prog, sizes, say, workloads)
    results = [o["result"] for o in outs]
    summaries = _report_regimes(regimes, results, emit)
    replayed = cfg0["workload"]["trace"] is not None
    doc = {
        "name": cfg0["name"],
        "hardware": where,
        "model": first.model.name,
        "kv_demand_ratio": demand0.ratio,  # report.KVDemand: the largest requests that can run at once
        "kv_demand_requests": demand0.requests,
        "config": cfg0,
        "regimes": summaries,
        "runs": results,
    }
    _write_outputs(doc, outs, emit, json_path, requests_path, timeline_path, metrics_path, plots_dir)
    if replayed and plots_dir is not None:
        runs0 = [r for r in results if r["regime"] == regimes[0][0]]
        for p in trace_report.plot(workloads[regimes[0][0]], runs0, setups0, plots_dir, cfg0["name"]):
            emit(f"wrote {p}")
    return doc


def write_metrics(path: Path, readings: list[tuple[dict[str, str], Reading]]) -> None:
    """Write the runs' metrics as one Prometheus text exposition (needs the metrics extra)."""
    from tiered_kv.obs.prometheus import exposition
    from tiered_kv.sim.files import write_text

    write_text(path, exposition(readings), "--metrics")


def write_timeline(path: Path, events: list[dict[str, Any]]) -> None:
    """Write Chrome trace events as a JSON object file (``chrome://tracing``, Perfetto)."""
    from tiered_kv.sim.files import write_text

    write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), "--timeline")
