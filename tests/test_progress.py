"""Progress: a bar on a terminal, a line at least every 10 s elsewhere (fake clock, a real pty)."""

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import yaml
from simutil import TINY

from tiered_kv.sim.progress import Phases, Progress


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def log_progress(**kw):
    clock, out = FakeClock(), io.StringIO()
    p = Progress("simulate", 100, "requests", stream=out, tty=False, clock=clock, heartbeat=False, **kw)
    return p, clock, out


def test_off_a_terminal_a_line_at_start_then_at_least_every_interval():
    p, clock, out = log_progress()
    assert out.getvalue() == "simulate: 0/100 requests (0%), 0:00:00 elapsed, ETA ?\n"
    clock.t += 4
    p.update(20, "run a")
    clock.t += 5.9  # 9.9 s since the last line: not yet
    p.update(40)
    assert out.getvalue().count("\n") == 1
    clock.t += 0.1  # 10 s since the last line
    p.update(50)
    lines = out.getvalue().splitlines()
    assert lines[1] == "simulate: 50/100 requests (50%), 0:00:10 elapsed, ETA 0:00:10 (run a)"


def test_off_a_terminal_the_heartbeat_tick_reports_a_silent_phase():
    p, clock, out = log_progress()
    p.update(25)
    for _ in range(3):  # nothing reports for 30 s; tick (the heartbeat thread's call) still prints
        clock.t += 10
        p.tick()
    lines = out.getvalue().splitlines()
    assert lines[1:] == [
        "simulate: 25/100 requests (25%), 0:00:10 elapsed, ETA 0:00:30",
        "simulate: 25/100 requests (25%), 0:00:20 elapsed, ETA 0:01:00",
        "simulate: 25/100 requests (25%), 0:00:30 elapsed, ETA 0:01:30",
    ]
    p.update(100)
    clock.t += 2
    p.close()
    assert out.getvalue().splitlines()[-1] == "simulate: 100/100 requests (100%), done in 0:00:32"
    p.close()  # idempotent
    assert out.getvalue().splitlines()[-1].endswith("done in 0:00:32")


def test_the_heartbeat_thread_prints_without_any_update():
    out = io.StringIO()
    p = Progress("crossover", 4, "steps", stream=out, tty=False, interval_s=0.01)
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 4 and all(line.startswith("crossover: 0/4 steps (0%)") for line in lines[:3])


def test_done_never_goes_back_or_past_the_total():
    p, _, _ = log_progress()
    p.update(30)
    p.update(10)
    assert p.done == 30
    p.advance(500)
    assert p.done == 100


def test_disabled_writes_nothing():
    out = io.StringIO()
    p = Progress("x", 5, stream=out, tty=False, enabled=False)
    p.update(3)
    p.tick()
    p.close()
    assert out.getvalue() == ""


def test_on_a_terminal_a_tqdm_bar():
    out = io.StringIO()
    with Progress("simulate", 10, "requests", stream=out, tty=True, heartbeat=False) as p:
        p.update(3, "run a")
        p.update(10)
    text = out.getvalue()
    assert "\r" in text and "simulate" in text and "10/10" in text and "|" in text


def test_wrap_prints_around_the_bar():
    out, printed = io.StringIO(), []
    with Progress("simulate", 10, stream=out, tty=True, heartbeat=False) as p:
        p.update(5)
        p.wrap(printed.append)("a result line")
    assert printed == ["a result line"]


def test_phases_open_one_progress_per_phase():
    out = io.StringIO()
    with Phases("crossover", stream=out, tty=False, heartbeat=False) as phases:
        phases("measuring", 0, 3)
        phases("measuring", 3, 3)
        phases("fitting", 0, 4)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("crossover: measuring: 0/3 steps")
    assert lines[1].startswith("crossover: measuring: 3/3 steps (100%), done in")
    assert lines[2].startswith("crossover: fitting: 0/4 steps")
    assert lines[3].startswith("crossover: fitting: 0/4 steps (0%), done in")


@pytest.fixture
def tiny_config(tmp_path):
    raw = dict(TINY)
    raw["workload"] = dict(TINY["workload"], num_requests=6)
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def cli(*args):
    return [sys.executable, "-m", "tiered_kv.cli", *map(str, args)]


def test_simulate_in_a_log_prints_progress_lines(tiny_config):
    r = subprocess.run(cli("simulate", tiny_config), capture_output=True, text=True, check=True)
    lines = r.stderr.splitlines()
    assert lines[0] == "simulate: 0/6 requests (0%), 0:00:00 elapsed, ETA ?"
    assert lines[-1].startswith("simulate: 6/6 requests (100%), done in")
    assert "\r" not in r.stderr
    quiet = subprocess.run(cli("simulate", tiny_config, "--no-progress"), capture_output=True, text=True, check=True)
    assert quiet.stderr == ""


@pytest.mark.parametrize("columns", [120, 0], ids=["sized", "no-size"])
def test_simulate_on_a_terminal_draws_a_bar(tiny_config, columns):
    main_fd, worker_fd = pty.openpty()
    fcntl.ioctl(worker_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(cli("simulate", tiny_config), stdout=subprocess.DEVNULL, stderr=worker_fd)
    os.close(worker_fd)
    chunks = []
    while True:
        ready, _, _ = select.select([main_fd], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(main_fd, 4096)
        except OSError:  # the pty closes when the process exits
            break
        if not data:
            break
        chunks.append(data)
    os.close(main_fd)
    assert proc.wait(60) == 0
    text = b"".join(chunks).decode()
    assert "\r" in text and "6/6" in text and "100%|" in text
    assert "elapsed" not in text  # the log format is for logs only


def test_crossover_and_fidelity_report_every_phase_step(tmp_path):
    pytest.importorskip("torch")
    from tiered_kv.bench.crossover import crossover
    from tiered_kv.cli.fidelity import fidelity
    from tiered_kv.engine.model import ModelConfig

    model = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
    )
    calls = []
    _, cal = crossover(
        model,
        block_size=4,
        lengths=[32, 64],
        repeats=1,
        emit=lambda s: None,
        step_scale=0.1,
        progress=lambda *a: calls.append(a),
    )
    measuring, fitting = "measuring swap and recompute", "fitting the step model on engine runs"
    assert calls == [(measuring, k, 2) for k in range(3)] + [(fitting, k, 4) for k in range(5)]

    cal.save(tmp_path / "cal.json")
    raw = {k: v for k, v in TINY.items() if k not in ("memory", "workload", "runs", "model")}
    raw["memory"] = {"block_size": 4, "gpu_blocks": 10, "cpu_blocks": 64, "activation_reserve_gib": 0}
    raw["workload"] = dict(TINY["workload"], num_requests=3, arrival={"process": "fixed", "rate": 1000.0})
    raw["runs"] = [{"name": "recompute", "mode": "recompute", "cpu_kv_gib": 0}, {"name": "swap", "mode": "swap"}]
    (tmp_path / "fid.yaml").write_text(yaml.safe_dump(raw))
    calls.clear()
    fidelity(tmp_path / "cal.json", tmp_path / "fid.yaml", emit=lambda s: None, progress=lambda *a: calls.append(a))
    assert calls == [("simulating and serving each run", k, 4) for k in range(5)]


def test_crossover_command_in_a_log_prints_each_phase(tmp_path, capsys):
    pytest.importorskip("torch")
    from tiered_kv.cli import main

    small = ["--max-tokens", "256", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1"]
    out = tmp_path / "cal.json"
    assert main(["crossover", *small, "--head-dim", "16", "--repeats", "1", "--calibration-out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == "crossover: measuring swap and recompute: 0/1 steps (0%), 0:00:00 elapsed, ETA ?"
    # (a slow machine may add heartbeat lines in between)
    assert any(x.startswith("crossover: measuring swap and recompute: 1/1 steps (100%), done in") for x in lines)
    assert any(x.startswith("crossover: fitting the step model on engine runs: 0/4 steps (0%)") for x in lines)
    assert lines[-1].startswith("crossover: fitting the step model on engine runs: 4/4 steps (100%), done in")
    assert f"wrote calibration {out}" in captured.out and out.exists()
