"""``tiered-kv simulate`` and ``tiered-kv sweep``: run configs, print, write JSON and plots."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiered_kv.sim.calibration import load_calibration
from tiered_kv.sim.config import load_config, setup
from tiered_kv.sim.report import demand_ratio, plot, plot_sweep, table, write_json
from tiered_kv.sim.simulator import Simulator, stderr_progress
from tiered_kv.sim.workload import generate


def simulate(
    config: str | Path | None = None,
    json_path: Path | None = None,
    plots_dir: Path | None = None,
    overrides: dict[str, Any] | None = None,
    emit: Callable[[str], None] = print,
    progress: bool = True,
    calibration: Path | None = None,
) -> dict[str, Any]:
    """Run every ``runs`` entry of a config on one workload; return the results document.

    With ``calibration`` (from ``tiered-kv crossover``) the measured model, link
    and step times replace the config's hardware and model profiles.
    """
    cal = load_calibration(calibration) if calibration is not None else None
    cfg = load_config(config, overrides, cal)
    workload = generate(cfg["workload"], cfg["seed"])
    first = setup(cfg, 0, cal)
    ratio = demand_ratio(cfg, first, workload)
    where = f"{cal.device} (calibrated)" if cal is not None else first.hardware.name
    emit(
        f"{cfg['name']}: {first.model.name} on {where}, {len(workload)} requests, "
        f"GPU KV {first.gpu_kv_gib:g} GiB ({first.num_gpu_blocks} blocks of {first.block_size} tokens), "
        f"KV demand of {cfg['scheduler']['max_num_seqs']} running requests = {ratio:.2f}x the GPU pool"
    )
    results = []
    for i in range(len(cfg["runs"])):
        st = setup(cfg, i, cal)
        t0 = time.perf_counter()
        res = Simulator(st, workload, progress=stderr_progress(st.name) if progress else None).run()
        wall = time.perf_counter() - t0
        emit(
            f"  {st.name}: {res['makespan_s']:.1f} simulated s in {wall:.1f} wall s "
            f"({res['makespan_s'] / wall:.1f} sim-s/s, {len(workload) / wall:.0f} requests/s)"
        )
        results.append(res)
    emit("")
    emit(table(results))
    doc = {
        "name": cfg["name"],
        "hardware": where,
        "model": first.model.name,
        "kv_demand_ratio": ratio,
        "config": cfg,
        "runs": results,
    }
    if json_path is not None:
        write_json(json_path, doc)
        emit(f"\nwrote {json_path}")
    if plots_dir is not None:
        for p in plot(results, plots_dir, cfg["name"]):
            emit(f"wrote {p}")
    return doc


def sweep(
    config: str | Path,
    json_path: Path | None = None,
    plots_dir: Path | None = None,
    emit: Callable[[str], None] = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Cross the config's runs with ``sweep.gpu_kv_gib`` and ``sweep.rate``."""
    base = load_config(config)
    mems = base["sweep"]["gpu_kv_gib"] or [base["memory"]["gpu_kv_gib"]]
    rates = base["sweep"]["rate"] or [base["workload"]["arrival"]["rate"]]
    rows: list[dict[str, Any]] = []
    for rate in rates:
        for mem in mems:
            cfg = load_config(config, {"workload.arrival.rate": rate, "memory.gpu_kv_gib": mem})
            workload = generate(cfg["workload"], cfg["seed"])
            for i, run in enumerate(cfg["runs"]):
                st = setup(cfg, i)
                name = f"{st.name} kv={mem:g} rate={rate:g}"
                res = Simulator(st, workload, progress=stderr_progress(name) if progress else None).run()
                rows.append(
                    {
                        "run": run["name"],
                        "policy": run["policy"],
                        "mode": run["mode"],
                        "rate": rate,
                        "gpu_kv_gib": mem,
                        "throughput_rps": res["throughput_rps"],
                        "e2e_p99_s": res["e2e_s"]["p99"],
                        "preemptions": res["preemptions_swap"] + res["preemptions_recompute"],
                    }
                )
    runs = list(dict.fromkeys(r["run"] for r in rows))
    emit(
        f"{'rate':>6} {'GPU KV GiB':>10} "
        + " ".join(f"{n[:20]:>20}" for n in runs)
        + "   cost-aware >= best fixed mode"
    )
    verdicts = []
    for rate in rates:
        for mem in mems:
            cell = {r["run"]: r for r in rows if r["rate"] == rate and r["gpu_kv_gib"] == mem}
            fixed = [r["throughput_rps"] for r in cell.values() if r["mode"] in ("swap", "recompute")]
            smart = [r["throughput_rps"] for r in cell.values() if r["policy"] == "cost_aware" and r["mode"] == "auto"]
            verdict = None
            if fixed and smart:
                verdict = min(smart) >= max(fixed)
                verdicts.append(
                    {
                        "rate": rate,
                        "gpu_kv_gib": mem,
                        "cost_aware_at_least_best_fixed": verdict,
                        "ratio_to_best_fixed": min(smart) / max(fixed),
                    }
                )
            emit(
                f"{rate:6g} {mem:10g} "
                + " ".join(f"{cell[n]['throughput_rps']:20.2f}" for n in runs)
                + ("" if verdict is None else f"   {'yes' if verdict else 'NO'} ({min(smart) / max(fixed):.3f}x)")
            )
    doc = {"name": base["name"], "rows": rows, "verdicts": verdicts}
    if json_path is not None:
        write_json(json_path, doc)
        emit(f"\nwrote {json_path}")
    if plots_dir is not None:
        emit(f"wrote {plot_sweep(rows, plots_dir, base['name'] + ' sweep')}")
    return doc
