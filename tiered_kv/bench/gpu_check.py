"""``tiered-kv gpu-check``: one command that proves the CUDA half, sized to a few minutes of a GPU.

Parts, in order, each with its own share of the time budget and each saved to
``OUT/gpu-check.json`` as soon as it has anything (:mod:`~tiered_kv.bench.report`):

1. ``device``: what the numbers were measured on (first, because it costs a
   second and a partial run must still say where it ran);
2. ``tests``: the test suite's tests marked ``gpu`` (the engine's exactness
   matrix on CUDA, the copy engines' ordering and asynchrony), in a child
   process; log in ``OUT/pytest-gpu.log``;
3. ``bandwidth``: every copy engine, layout, block size, id pattern and
   direction, against one contiguous copy and a per-block copy loop;
4. ``overlap``: compute beside swaps both ways, layer-wise swap-in, host
   synchronisations counted three ways; ``OUT/gpu-check-trace.json`` is the
   Perfetto trace of those rounds (open it at https://ui.perfetto.dev);
5. ``crossover``: swap against recompute at real size (Llama-3-8B's shape,
   random bf16 weights); rows in ``OUT/crossover.jsonl`` as measured, and
   ``OUT/calibration.json`` for ``tiered-kv simulate --calibration``.

The ``--cpu`` form runs the same code with tiny shapes and the CPU copy
engine in under a minute, so CI exercises every path; its numbers describe a
CPU, never a GPU.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import tiered_kv
from tiered_kv.bench.bandwidth import run_bandwidth
from tiered_kv.bench.crossover import real_crossover
from tiered_kv.bench.device import device_facts, hardware_line
from tiered_kv.bench.model import LLAMA3_8B_SHAPE, SMALL_SHAPE, LlamaShape
from tiered_kv.bench.overlap import run_overlap
from tiered_kv.bench.report import Deadline, Report
from tiered_kv.bench.timing import RowFile
from tiered_kv.storage.spec import LLAMA3_8B, KVSpec

# The two forms of gpu-check: the real one for a GPU, and a small one that runs the same code on a CPU.
#
# Every size and time budget lives here.  The GPU form is sized to finish in
# under 8 minutes on one H200 (its parts' budgets add up to 440 s, and a hard
# limit ends the command at about 470 s whatever happens); the CPU form runs every
# code path with tiny shapes in under a minute on two cores, so CI keeps it from
# rotting.

PARTS = ("device", "tests", "bandwidth", "overlap", "crossover")


@dataclass(frozen=True)
class Form:
    """Sizes and budgets of one form.

    Attributes:
        name: ``"gpu"`` or ``"cpu"``.
        device: Where the GPU tier and compute live.
        total_s: The command's budget (see :attr:`hard_stop_s`).
        budgets: Seconds per part (each part stops cleanly when its share runs out).
        kv: KV shape of the bandwidth and overlap copies (its block size is replaced per case).
        block_tokens: Block sizes of the bandwidth matrix.
        mib_per_case: MiB each direction moves per bandwidth case.
        repeats: Timed runs per point (after one untimed run).
        compute_shape: The model whose forward pass is the overlap's compute.
        compute_tokens: Tokens of that forward pass (a prefill: compute-bound on a GPU).
        overlap_mib: MiB each direction of the overlap's swaps.
        layerwise_context: Context tokens of the layer-wise swap-in scenario.
        layerwise_chunk: New tokens computed after that context arrives.
        model: The crossover's model (real size on a GPU).
        lengths: The crossover's context lengths.
        decode_points: ``(batch, context)`` decode steps for the step-model fit.
        torch_threads: Intra-op threads for torch on the host (``None``: torch's default).  The
            CPU form uses one: on a loaded two-core machine a two-thread copy waits for a
            descheduled helper thread and took 100x longer than a one-thread copy.
    """

    name: str
    device: str
    total_s: float
    budgets: dict[str, float]
    kv: KVSpec
    block_tokens: tuple[int, ...]
    mib_per_case: int
    repeats: int
    compute_shape: LlamaShape
    compute_tokens: int
    overlap_mib: int
    layerwise_context: int
    layerwise_chunk: int
    model: LlamaShape
    lengths: tuple[int, ...]
    decode_points: tuple[tuple[int, int], ...]
    block_size: int = 16
    layouts: tuple[str, ...] = ("block_contiguous", "layer_first")
    pytest_marker: str = "gpu"
    torch_threads: int | None = None

    @property
    def hard_stop_s(self) -> float:
        """When the process ends whatever happens: a little before ``total_s``, after every part's budget."""
        return self.total_s - max(2.0, 0.02 * self.total_s)

    def scaled(self, total_s: float) -> Form:
        """The same form with every part's budget scaled to a new total."""
        k = total_s / self.total_s
        return replace(self, total_s=total_s, budgets={p: b * k for p, b in self.budgets.items()})


GPU_FORM = Form(
    name="gpu",
    device="cuda",
    total_s=480.0,
    budgets={"device": 10.0, "tests": 150.0, "bandwidth": 110.0, "overlap": 60.0, "crossover": 110.0},
    kv=LLAMA3_8B,
    block_tokens=(16, 32, 64),
    mib_per_case=256,
    repeats=5,
    # Eight of Llama-3-8B's layers: a 4096-token prefill is tens of milliseconds of matmuls.
    compute_shape=LLAMA3_8B_SHAPE.with_layers(8),
    compute_tokens=4096,
    overlap_mib=1024,
    layerwise_context=8192,
    layerwise_chunk=1024,
    model=LLAMA3_8B_SHAPE,
    lengths=(512, 1024, 2048, 4096, 8192, 16384, 32768),
    decode_points=((1, 1024), (8, 1024), (32, 1024), (1, 4096), (8, 4096), (32, 4096)),
)

CPU_FORM = Form(
    name="cpu",
    device="cpu",
    total_s=60.0,
    budgets={"device": 3.0, "tests": 18.0, "bandwidth": 8.0, "overlap": 8.0, "crossover": 13.0},
    kv=KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16"),
    block_tokens=(16, 32, 64),
    mib_per_case=4,
    repeats=3,
    compute_shape=SMALL_SHAPE,
    compute_tokens=256,
    overlap_mib=4,
    layerwise_context=512,
    layerwise_chunk=64,
    model=SMALL_SHAPE,
    lengths=(64, 128, 256, 512),
    decode_points=((1, 64), (4, 64), (1, 256), (4, 256)),
    torch_threads=1,
)


FILES = {
    "results": "gpu-check.json",
    "log": "gpu-check.log",
    "trace": "gpu-check-trace.json",
    "trace_gz": "gpu-check-trace.json.gz",
    "pytest_log": "pytest-gpu.log",
    "crossover_rows": "crossover.jsonl",
    "calibration": "calibration.json",
}


class Log:
    """Prints a line and appends it to ``gpu-check.log`` (flushed, so a killed run keeps its log)."""

    def __init__(self, path: Path, echo: Callable[[str], None] = print) -> None:
        self.fh = path.open("w", encoding="utf-8")
        self.echo = echo

    def __call__(self, text: str) -> None:
        self.echo(text)
        self.fh.write(text + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class GpuCheck:
    """Runs the parts of one form into one output directory."""

    def __init__(
        self, out: Path, form: Form, parts: Sequence[str] = PARTS, argv: Sequence[str] = (), echo: Any = print
    ) -> None:
        self.out = out
        self.form = form
        self.parts = [p for p in PARTS if p in parts]
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES.values():  # an earlier run's files would pass for this run's
            (out / name).unlink(missing_ok=True)
        if form.torch_threads is not None:
            torch.set_num_threads(form.torch_threads)
        self.log = Log(out / FILES["log"], echo)
        self.report = Report(
            out / FILES["results"],
            {
                "form": form.name,
                "command": " ".join(argv),
                "budget_s": form.total_s,
                "hard_stop_s": form.hard_stop_s,
                "budgets_s": {p: form.budgets[p] for p in self.parts},
                "torch_threads": torch.get_num_threads(),
            },
            self.parts,
        )
        self.report.add_file("log", out / FILES["log"])
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------ parts
    def _device(self, deadline: Deadline, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        facts = device_facts()
        line = hardware_line(facts)
        self.report.set("hardware", line)
        self.log(f"device: {line}")
        return facts

    def _tests(self, deadline: Deadline, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        path = self.out / FILES["pytest_log"]
        self.log(f"tests: running the tests marked '{self.form.pytest_marker}' (log: {path})")
        res = run_gpu_tests(path, deadline, self.form.pytest_marker, children=self.report.children)
        if res.get("ran"):
            self.report.add_file("pytest_log", path)
            self.log(
                f"tests: {res['summary'] or 'no summary (stopped)'}; "
                + ("all passed" if res["passed"] else f"NOT all passed: {res['problems'][:10]}")
                + (f"; skipped: {res['skip_reasons']}" if res["skip_reasons"] else "")
            )
        else:
            self.log(f"tests: not run: {res['why']}")
        return res

    def _bandwidth(self, deadline: Deadline, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        f = self.form
        res = run_bandwidth(
            f.kv, f.block_tokens, f.layouts, f.mib_per_case, f.repeats, f.device, deadline, self.log, save
        )
        for g in res.get("goals", []):
            if g["applies"]:
                self.log(
                    f"goal {g['goal']} ({g['engine']}): worst {g['worst']:.2f} at {g['worst_case']}, need "
                    f"{g['threshold']}: {'met' if g['met'] else 'NOT met'}"
                )
        return res

    def _overlap(self, deadline: Deadline, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        f = self.form
        trace = self.out / FILES["trace"]
        res = run_overlap(
            f.compute_shape,
            f.kv,
            f.compute_tokens,
            f.overlap_mib,
            f.layerwise_context,
            f.layerwise_chunk,
            f.block_size,
            f.device,
            f.repeats,
            deadline,
            self.log,
            save,
            trace,
        )
        written = (res.get("trace") or {}).get("file")
        if written:
            self.report.add_file("trace", self.out / written)
        return res

    def _crossover(self, deadline: Deadline, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        f = self.form
        rows_path = self.out / FILES["crossover_rows"]
        device_name = self.report.doc.get("hardware") or f.device
        with RowFile(rows_path) as rows:
            self.report.add_file("crossover_rows", rows_path)
            doc, cal = real_crossover(
                f.model,
                f.block_size,
                f.lengths,
                f.repeats,
                f.device,
                f.decode_points,
                rows,
                deadline.expired,
                self.log,
                save,
                device_name,
            )
        if cal is not None:
            path = self.out / FILES["calibration"]
            cal.save(path, {"source": "tiered-kv gpu-check", "hardware": device_name})
            self.report.add_file("calibration", path)
            self.log(f"crossover: wrote {path} (for tiered-kv simulate --calibration)")
        return doc

    # ------------------------------------------------------------------- run
    def run_part(self, name: str) -> None:
        budget = self.form.budgets[name]
        deadline = Deadline(budget)
        self.report.update(name, status="running", budget_s=budget)
        self.log(f"== {name} (budget {budget:.0f} s)")

        def save(result: dict[str, Any]) -> None:
            self.report.update(name, result=result, elapsed_s=deadline.elapsed)

        fn = getattr(self, f"_{name}")
        try:
            result = fn(deadline, save)
        except Exception as exc:
            tb = traceback.format_exc().strip().splitlines()[-12:]
            self.report.update(
                name, status="failed", error=f"{type(exc).__name__}: {exc}", traceback=tb, elapsed_s=deadline.elapsed
            )
            self.log(f"{name}: FAILED: {type(exc).__name__}: {' '.join(str(exc).split())}")
            return
        finally:
            _free_memory()
        stopped = result.get("stopped")
        status = "partial" if stopped else "done"
        if name == "tests" and not result.get("ran"):
            status = "skipped"
        self.report.update(name, status=status, result=result, elapsed_s=deadline.elapsed, stopped=stopped)
        self.log(f"{name}: {status} in {deadline.elapsed:.1f} s" + (f" ({stopped})" if stopped else ""))

    def run(self) -> dict[str, Any]:
        for name in self.parts:
            self.run_part(name)
        self.report.set("elapsed_s", time.monotonic() - self.t0)
        self.report.set("verdict", verdict(self.report.doc))
        self.report.finish()
        for line in self.report.doc["verdict"]["lines"]:
            self.log(line)
        self.log(f"wrote {self.out / FILES['results']} in {time.monotonic() - self.t0:.0f} s")
        self.log.close()
        return self.report.doc


def verdict(doc: dict[str, Any]) -> dict[str, Any]:
    """What the run showed, in a few lines and flags (the numbers stay in the parts)."""
    parts = doc["parts"]
    lines = [f"gpu-check ({doc['form']} form) on {doc.get('hardware', 'unknown hardware')}"]
    flags: dict[str, Any] = {}
    for name, p in parts.items():
        lines.append(f"  {name}: {p['status']}" + (f" ({p.get('stopped')})" if p.get("stopped") else ""))
    t = parts.get("tests", {}).get("result") or {}
    if t.get("ran"):
        flags["tests_passed"] = t["passed"]
        lines.append(f"  tests: {t.get('counts')}; problems: {len(t.get('problems', []))}")
    b = parts.get("bandwidth", {}).get("result") or {}
    goals = [g for g in b.get("goals", []) if g["applies"]]
    if goals:
        flags["bandwidth_goals_met"] = all(g["met"] for g in goals)
        for g in goals:
            met = "met" if g["met"] else "NOT met"
            lines.append(f"  goal {g['goal']} ({g['engine']}): {met} (worst {g['worst']:.2f})")
    o = parts.get("overlap", {}).get("result") or {}
    for d in o.get("duplex", []):
        if "slowdown" in d:
            lines.append(
                f"  overlap ({d['engine']}): compute slowdown {d['slowdown']:.2f}x, {d['hidden']:.0%} of copy time "
                f"hidden, host syncs in issuing regions: {d['syncs_python']} python / {d['syncs_debug_mode']} debug"
            )
    tr = o.get("trace")
    if tr:
        flags["trace_syncs_in_regions"] = sum(r["total"] for r in tr["regions"].values())
        lines.append(
            f"  trace: {flags['trace_syncs_in_regions']} blocking CUDA calls in the issuing regions; control "
            f"region {tr['control']['total']}"
        )
    c = parts.get("crossover", {}).get("result") or {}
    if c.get("winners"):
        lines.append(f"  crossover: {c['winners']}; first change at {c.get('crossover_tokens')}")
    return {"lines": lines, **flags}


def exit_status(doc: dict[str, Any]) -> int:
    """0 when every part ran to the end and no test failed; 1 otherwise (the results are written either way)."""
    ok = all(p["status"] in ("done", "skipped") for p in doc["parts"].values())
    return 0 if ok and doc.get("verdict", {}).get("tests_passed", True) else 1


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
# Test ids may hold spaces (parametrised messages): the outcome is the last such word before the percentage.
LINE = re.compile(r"^(?P<test>\S+::.*?)\s+(?P<outcome>" + "|".join(OUTCOMES) + r")(?P<rest>(?:\s.*)?)$")
SKIP = re.compile(r"^SKIPPED \[(?P<n>\d+)\] \S+: (?P<why>.*)$")
COLLECT = re.compile(r"^_+ ERROR collecting (?P<module>\S+) _+$")
SUMMARY = re.compile(r"^=+ (?P<summary>.*\bin [\d.]+s.*) =+$")


def tests_dir() -> Path | None:
    """The checkout's ``tests/`` beside the package, or None for an installed package."""
    d = Path(tiered_kv.__file__).resolve().parents[1] / "tests"
    return d if d.is_dir() else None


def parse(log: str) -> dict[str, Any]:
    """Outcome counts, the tests that did not pass or skip, modules that failed to import, and the summary line.

    A module that fails to import may hold gpu tests that never ran, so it
    counts against passing like a failed test.
    """
    counts: Counter[str] = Counter()
    problems: list[dict[str, str]] = []
    skipped: Counter[str] = Counter()
    collection: list[str] = []
    summary = None
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            outcome = m["outcome"]
            counts[outcome.lower()] += 1
            if outcome in ("FAILED", "ERROR", "XPASS"):
                problems.append({"test": m["test"], "outcome": outcome.lower()})
            continue
        k = SKIP.match(line)
        if k:
            skipped[k["why"]] += int(k["n"])
            continue
        c = COLLECT.match(line)
        if c:
            collection.append(c["module"])
            continue
        s = SUMMARY.match(line)
        if s:
            summary = s["summary"]
    return {
        "counts": dict(counts),
        "problems": problems,
        "skip_reasons": dict(skipped),
        "collection_errors": collection,
        "summary": summary,
    }


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Stop the child's whole process group: politely, then for good."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_gpu_tests(
    log_path: Path,
    deadline: Deadline,
    marker: str = "gpu",
    extra_args: tuple[str, ...] = (),
    children: list[int] | None = None,
) -> dict[str, Any]:
    """Run the marked tests within ``deadline``; return the parsed outcome and how the run ended.

    The child is ``python -m pytest -m gpu -v`` over the checkout's ``tests/``;
    its output goes to ``log_path``, and each test's outcome is read from the
    verbose lines as they appear, so a child stopped at the time limit still
    reports every test that finished.  The project's own pytest options are not
    used (``-o addopts=``), so a missing benchmark plugin cannot stop the run;
    collection errors in unrelated modules do not stop it either.  On a machine
    without CUDA every selected test skips, and the part says so.

    The child runs in its own process group, whose id is appended to
    ``children`` while it runs, so a hard stop of the whole command can end it too.
    """
    tests = tests_dir()
    if tests is None:
        return {"ran": False, "why": "no tests/ directory beside the package (run from a source checkout)"}
    root = tests.parent
    cmd = _pytest_command(marker, extra_args, tests)
    env = _child_env(root)
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        stopped = _supervise(proc, deadline, children)
    result = parse(log_path.read_text(errors="replace"))
    result.update(
        {
            "ran": True,
            "command": " ".join(cmd[2:]),
            "returncode": proc.returncode,
            "seconds": time.monotonic() - t0,
            "stopped": stopped,
            "log": log_path.name,
        }
    )
    # pytest: 0 all passed, 1 some failed, 5 nothing collected (every test deselected).
    result["passed"] = (
        stopped is None and proc.returncode in (0, 5) and not result["problems"] and not result["collection_errors"]
    )
    return result


def _pytest_command(marker: str, extra_args: tuple[str, ...], tests: Path) -> list[str]:
    """``python -m pytest`` over ``tests`` for the marked tests, verbose, without the project's own options."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        marker,
        "-v",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--continue-on-collection-errors",
        *extra_args,
        str(tests),
    ]


def _child_env(root: Path) -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH`` and unbuffered output, so the log is live."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _supervise(proc: subprocess.Popen[bytes], deadline: Deadline, children: list[int] | None) -> str | None:
    """Wait for the child until it ends or ``deadline`` expires; return why it was stopped, or None.

    Whatever happens (an interrupt included), the child is not left running.
    """
    if children is not None:
        children.append(proc.pid)
    stopped = None
    try:
        while proc.poll() is None:
            if deadline.expired():
                stopped = f"stopped at the part's time budget of {deadline.seconds:.0f} s"
                _end(proc)
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # interrupted: never leave the child running
            _end(proc)
        if children is not None:
            children.remove(proc.pid)
    return stopped
