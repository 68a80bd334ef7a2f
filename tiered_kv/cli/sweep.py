"""``tiered-kv sweep``: a config's runs crossed with GPU KV sizes and arrival rates, serial or in parallel.

Every (rate, GPU KV size, run) is one *cell*: a self-contained task that
builds its own setup and workload from the validated config and returns one
result row.  The same :func:`run_cell` runs in this process, in worker
processes (``workers > 1``, :mod:`concurrent.futures`) or as Ray tasks on a
cluster (``ray_address``).  A cell's result depends only on its inputs (the
seed is in the config), and rows are gathered in cell order, so the results
document is the same byte for byte however the cells were run.

The flags import nothing heavy (``tiered-kv --help`` works on a base install);
the simulator is imported by the functions that run it.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.cli.flags import add_json, add_no_progress, add_plots, add_workers, config_inputs, need_extras
from tiered_kv.cli.simulate import in_processes
from tiered_kv.errors import TieredKVError

if TYPE_CHECKING:
    from tiered_kv.sim.progress import Progress

NAME = "sweep"
SUMMARY = "cross a config's runs with GPU KV sizes and arrival rates"
DESCRIPTION = (
    "Run every (arrival rate, GPU KV size, run) cell of a config's `sweep:` section and print "
    "throughput per cell.  The results are the same, byte for byte, however the cells are run.  "
    "Needs the sim extra; --ray needs the ray extra."
)


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``sweep``."""
    p.add_argument("config", help="a YAML config file with a `sweep:` section, or the name of a shipped config")
    add_json(p, "write the results document (JSON) to this file")
    add_plots(p, "write sweep.png into this directory")
    where = p.add_mutually_exclusive_group()
    add_workers(where, "run cells in N processes on this machine (default: 1, in this process)")
    where.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run cells as Ray tasks on the cluster at ADDRESS (host:port, 'auto', or 'local' for a new "
        "local instance); the workers need tiered-kv installed",
    )
    add_no_progress(p)


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a sweep reads: the config, its profiles and trace."""
    return config_inputs(args.config)


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    need_extras((args.ray, "ray", "--ray"), (args.plots, "matplotlib", "--plots"))
    sweep(
        args.config,
        args.json,
        args.plots,
        progress=not args.no_progress,
        workers=args.workers,
        ray_address=args.ray,
    )
    return 0


Hook = Callable[[int, int, float], None]


@dataclass(frozen=True)
class Cell:
    """One simulation of a sweep: the validated config of its (rate, GPU KV) point and a run index."""

    cfg: dict[str, Any]
    run_index: int
    rate: float
    gpu_kv_gib: float


def run_cell(cell: Cell, hook: Hook | None = None) -> dict[str, Any]:
    """Simulate one cell and return its result row (the unit of work for every executor)."""
    from tiered_kv.sim.config import setup
    from tiered_kv.sim.simulator import Simulator
    from tiered_kv.sim.workload import generate

    st = setup(cell.cfg, cell.run_index)
    workload = generate(cell.cfg["workload"], cell.cfg["seed"])
    res = Simulator(st, workload, progress=hook).run()
    run = cell.cfg["runs"][cell.run_index]
    return {
        "run": run["name"],
        "victim_policy": run["victim_policy"],
        "mode": run["mode"],
        "tier": tier_label(run),
        "rate": cell.rate,
        "gpu_kv_gib": cell.gpu_kv_gib,
        "throughput_rps": res["throughput_rps"],
        "e2e_p99_s": res["e2e_s"]["p99"],
        "preemptions": res["preemptions_swap"] + res["preemptions_recompute"],
    }


def plan_cells(config: str | Path) -> tuple[str, list[Cell], list[float], list[float]]:
    """Read and validate the config at every sweep point; return its name, the cells, the rates and sizes."""
    from tiered_kv.sim.config import config_from_raw, read_config, setup

    raw, stem = read_config(config)
    base = config_from_raw(raw, stem)
    mems = base["sweep"]["gpu_kv_gib"] or [base["memory"]["gpu_kv_gib"]]
    rates = base["sweep"]["rate"] or [base["workload"]["arrival"]["rate"]]
    points = [
        (rate, mem, config_from_raw(raw, stem, {"workload.arrival.rate": rate, "memory.gpu_kv_gib": mem}))
        for rate in rates
        for mem in mems
    ]
    # Without sizes to sweep (None), a point is labelled with the size its config resolves to.
    label = {mem: mem if mem is not None else setup(cfg, 0).gpu_kv_gib for _, mem, cfg in points}
    cells = [Cell(cfg, i, rate, label[mem]) for rate, mem, cfg in points for i in range(len(cfg["runs"]))]
    return base["name"], cells, rates, [label[m] for m in mems]


def _serial(cells: Sequence[Cell], prog: Progress, per_cell: int) -> list[dict[str, Any]]:
    rows = []
    for k, cell in enumerate(cells):
        note = f"{cell.cfg['runs'][cell.run_index]['name']} kv={cell.gpu_kv_gib:g} rate={cell.rate:g}"

        def hook(done: int, total: int, sim_t: float, base: int = k * per_cell, note: str = note) -> None:
            prog.update(base + done, note)

        rows.append(run_cell(cell, hook))
    return rows


def _processes(cells: Sequence[Cell], workers: int, prog: Progress, per_cell: int) -> list[dict[str, Any]]:
    finished = itertools.count(1)

    def done(k: int, row: dict[str, Any]) -> None:
        prog.advance(per_cell, f"{next(finished)}/{len(cells)} cells")

    return in_processes(run_cell, cells, workers, done, "sweep")


def _ray(cells: Sequence[Cell], address: str, prog: Progress, per_cell: int) -> list[dict[str, Any]]:
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.simulator import SimulationError

    ray = import_extra("ray", "--ray")
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as exc:
        raise SimulationError(
            f"--ray {address}: cannot connect to a Ray cluster ({' '.join(str(exc).split())})"
        ) from None
    try:
        task = ray.remote(num_cpus=1)(run_cell)
        refs = [task.remote(cell) for cell in cells]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            prog.advance(per_cell * len(done), f"{len(refs) - len(pending)}/{len(refs)} cells")
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, TieredKVError):
            raise cause from None
        raise SimulationError(f"a Ray task failed: {' '.join(str(cause or exc).split())}") from None
    finally:
        ray.shutdown()


def tier_label(run: dict[str, Any]) -> str:
    """What a run keeps below the GPU besides swapped KV: its CPU prefix tier and the tiers under it.

    Runs are compared only with runs of the same label: a CPU prefix tier's
    gain is the tier's, not the preemption policy's.
    """
    from tiered_kv.sim.tier_config import profile_name
    from tiered_kv.tiers.tier_kind import find_tier_kind

    if run["offload"] == "none":
        return "no CPU prefix tier"
    below = [profile_name(find_tier_kind(t["type"])) for t in run["tiers"]]
    return f"CPU prefix tier ({run['offload']})" + "".join(f" + {name}" for name in below)


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cost-aware run (mode auto) in each cell against the best fixed-mode run with the same tier label.

    A cost-aware run with no fixed-mode run of its own tier label in the cell
    gets no verdict (``best_fixed`` is None): there is nothing like it to beat.
    """
    out = []
    cells = dict.fromkeys((r["rate"], r["gpu_kv_gib"]) for r in rows)
    for rate, mem in cells:
        cell = [r for r in rows if r["rate"] == rate and r["gpu_kv_gib"] == mem]
        for smart in (r for r in cell if r["victim_policy"] == "cost_aware" and r["mode"] == "auto"):
            like = [r for r in cell if r["mode"] in ("swap", "recompute") and r["tier"] == smart["tier"]]
            best = max(like, key=lambda r: r["throughput_rps"], default=None)
            ratio = smart["throughput_rps"] / best["throughput_rps"] if best and best["throughput_rps"] else None
            out.append(
                {
                    "rate": rate,
                    "gpu_kv_gib": mem,
                    "run": smart["run"],
                    "tier": smart["tier"],
                    "best_fixed": best["run"] if best else None,
                    "ratio_to_best_fixed": ratio,
                    "cost_aware_at_least_best_fixed": None if ratio is None else ratio >= 1.0,
                }
            )
    return out


def _report(
    rows: list[dict[str, Any]], rates: list[float], mems: list[float], emit: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Print one line per cell (throughput per run, requests/s) and each cost-aware run's verdict; return those."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    tiers = {r["run"]: r["tier"] for r in rows}
    found = verdicts(rows)
    emit("throughput in requests/s, one column per run; each run's tier below the GPU:")
    for n in runs:
        emit(f"  {n}: {tiers[n]}")
    emit(
        "verdict: a cost-aware run's throughput over the best fixed-mode run (swap or recompute) with the same "
        "tier; n/a where no such run is in the sweep"
    )
    emit(f"{'rate req/s':>10} {'GPU KV GiB':>10} " + " ".join(f"{n[:20]:>20}" for n in runs) + "   verdict")
    for rate in rates:
        for mem in mems:
            cell = {r["run"]: r for r in rows if r["rate"] == rate and r["gpu_kv_gib"] == mem}
            said = []
            for v in found:
                if v["rate"] == rate and v["gpu_kv_gib"] == mem:
                    if v["ratio_to_best_fixed"] is None:
                        said.append(f"{v['run']}: n/a")
                    else:
                        ok = "yes" if v["cost_aware_at_least_best_fixed"] else "NO"
                        said.append(f"{v['run']} / {v['best_fixed']}: {v['ratio_to_best_fixed']:.3f}x {ok}")
            emit(
                f"{rate:10g} {mem:10g} "
                + " ".join(f"{cell[n]['throughput_rps']:20.2f}" for n in runs)
                + ("   " + "; ".join(said) if said else "")
            )
    return found


def sweep(
    config: str | Path,
    json_path: Path | None = None,
    plots_dir: Path | None = None,
    emit: Callable[[str], None] = print,
    progress: bool = True,
    workers: int = 1,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Cross the config's runs with ``sweep.gpu_kv_gib`` and ``sweep.rate``; return the results document.

    Args:
        workers: Run cells in this many processes on this machine (1: in this process).
        ray_address: Run cells as Ray tasks on the cluster at this address instead
            (``"auto"``, ``"host:port"``, or ``"local"`` for a new local instance).
            The workers need tiered-kv installed, and any trace or profile file
            the config names at the same path.
    """
    from tiered_kv.sim.budget import check
    from tiered_kv.sim.config import derived_fields, setup
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.progress import Progress
    from tiered_kv.sim.report import plot_sweep, write_json
    from tiered_kv.sim.simulator import SimulationError
    from tiered_kv.sim.workload import size

    if workers < 1:
        raise SimulationError(f"workers: must be >= 1, got {workers}")
    if plots_dir is not None:
        import_extra("matplotlib", "--plots")
    name, cells, rates, mems = plan_cells(config)
    work = size(cells[0].cfg["workload"])
    setups = [setup(c.cfg, c.run_index) for c in cells]
    if setups[0].uncalibrated:  # the sweep's first line: its step times are a default, not this GPU's
        emit(f"note: {setups[0].uncalibrated}")
    derived = list(dict.fromkeys(d for st in setups for d in derived_fields(st)))
    if derived:
        emit(f"derived, not given in the profiles: {'; '.join(derived)}")
    if ray_address is not None:
        check(work, setups, len(cells), parallel=len(cells), local_parallel=1)
    else:
        check(work, setups, len(cells), parallel=workers, local_parallel=workers)
    with Progress("sweep", len(cells) * work.requests, "requests", enabled=progress) as prog:
        if ray_address is not None:
            rows = _ray(cells, ray_address, prog, work.requests)
        elif workers > 1:
            rows = _processes(cells, workers, prog, work.requests)
        else:
            rows = _serial(cells, prog, work.requests)
    verdicts = _report(rows, rates, mems, emit)
    doc = {"name": name, "rows": rows, "verdicts": verdicts}
    if json_path is not None:
        write_json(json_path, doc)
        emit(f"\nwrote {json_path}")
    if plots_dir is not None:
        emit(f"wrote {plot_sweep(rows, plots_dir, name + ' sweep')}")
    return doc
