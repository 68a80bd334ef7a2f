"""``tiered-kv simulate``: run every entry of a config's ``runs`` on one workload; print, write JSON and plots."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiered_kv.sim.budget import build_workload
from tiered_kv.sim.calibration import load_calibration
from tiered_kv.sim.config import load_config, setup
from tiered_kv.sim.extras import import_extra
from tiered_kv.sim.progress import Progress
from tiered_kv.sim.report import demand_ratio, plot, table, write_json
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.sweep import sweep

__all__ = ["simulate", "sweep"]  # sweep lives in its own module; re-exported for existing callers


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

    ``config`` is a path, the name of a shipped config, or None for the main
    experiment.  With ``calibration`` (from ``tiered-kv crossover``) the
    measured model, link and step times replace the config's hardware and
    model profiles.  The workload's memory and time are estimated first, and a
    config that could not finish on this machine is refused before anything runs.
    """
    cal = load_calibration(calibration) if calibration is not None else None
    cfg = load_config(config, overrides, cal)
    setups = [setup(cfg, i, cal) for i in range(len(cfg["runs"]))]
    if plots_dir is not None:
        import_extra("matplotlib", "--plots")  # before the run, not after it
    workload = build_workload(cfg, setups)
    first = setups[0]
    ratio = demand_ratio(cfg, first, workload)
    where = f"{cal.device} (calibrated)" if cal is not None else first.hardware.name
    emit(
        f"{cfg['name']}: {first.model.name} on {where}, {len(workload)} requests, "
        f"GPU KV {first.gpu_kv_gib:g} GiB ({first.num_gpu_blocks} blocks of {first.block_size} tokens), "
        f"KV demand of {first.max_num_seqs} running requests = {ratio:.2f}x the GPU pool"
    )
    results = []
    n = len(workload)
    with Progress("simulate", n * len(setups), "requests", enabled=progress) as prog:
        say = prog.wrap(emit)
        for i, st in enumerate(setups):

            def hook(done: int, total: int, sim_t: float, base: int = i * n, name: str = st.name) -> None:
                prog.update(base + done, f"{name}, simulated {sim_t:.0f} s")

            t0 = time.perf_counter()
            res = Simulator(st, workload, progress=hook).run()
            wall = time.perf_counter() - t0
            say(
                f"  {st.name}: {res['makespan_s']:.1f} simulated s in {wall:.1f} wall s "
                f"({res['makespan_s'] / wall:.1f} sim-s/s, {n / wall:.0f} requests/s)"
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
