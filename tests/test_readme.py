"""The README and the library docs: their Python examples run as written, their links resolve, the README is short.

The README's results are two tables printed by ``bash scripts/run-main.sh``.  Their
layout is checked here against the tables the code prints; their numbers against a run
only on request (``TIERED_KV_README_RESULTS=out/results.json``, after running the main
job), since they change whenever the simulator's models do and are regenerated then.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tiered_kv.sim import run_tables

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
# The README's results: these tables of the main job's output, in this order.
RESULT_TABLES = (run_tables.LATENCY, run_tables.KV_SOURCES)


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run_blocks(path: Path) -> list[dict[str, Any]]:
    """Run each Python block of ``path`` in a namespace of its own; return the namespaces."""
    spaces = []
    for code in python_blocks(path):
        namespace: dict[str, Any] = {}
        exec(compile(code, str(path.relative_to(ROOT)), "exec"), namespace)
        spaces.append(namespace)
    return spaces


def test_the_readme_is_at_most_250_lines_and_keeps_the_two_commands_ci_runs_the_second():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "```bash\nbash scripts/run-main.sh\n```" in text
    assert "```bash\nbash scripts/test.sh\n```" in text
    assert "\nbash scripts/test.sh\n" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_scheduler_example_serves_every_request_preempting_on_the_way():
    (ns,) = run_blocks(README)
    assert sorted(ns["done"]) == [0, 1, 2, 3, 4]
    c = ns["sched"].tm.metrics().counters
    assert c.preemptions_swap + c.preemptions_recompute > 0


def test_the_library_docs_examples_run():
    pool, loop = run_blocks(ROOT / "docs" / "library.md")
    assert pool["req"].num_computed_tokens == 100 and pool["mgr"].block_pool.get_usage() == 0.0
    # The scheduler loop served every request, preempting on the way.
    assert sorted(loop["done"]) == [0, 1, 2, 3, 4]
    assert loop["tm"].metrics().counters.preemptions_swap > 0


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    for doc in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            assert (doc.parent / target.split("#")[0]).exists(), f"{doc.relative_to(ROOT)}: {target}"


def readme_results() -> list[str]:
    """The README's block of results: the lines of its ``text`` code block."""
    (block,) = re.findall(r"```text\n(.*?)```", README.read_text(), flags=re.S)
    return block.rstrip("\n").split("\n")


def test_the_readme_results_are_laid_out_as_the_main_job_prints_them():
    lines = readme_results()
    names = [line.split()[1] for line in lines if line[:2].strip().isdigit()]
    name_w = min(run_tables.NAME_WIDTH, max(len(n) for n in names))
    for t in RESULT_TABLES:
        head = t.head(name_w)
        at = lines.index(t.title)
        assert lines[at : at + len(head)] == head, t.title


@pytest.mark.skipif(
    not os.environ.get("TIERED_KV_README_RESULTS"),
    reason="set TIERED_KV_README_RESULTS to the main job's results.json to compare the README's numbers",
)
def test_the_readme_results_are_the_main_jobs_output():
    doc = json.loads(Path(os.environ["TIERED_KV_README_RESULTS"]).read_text())
    assert doc["name"] == "mooncake-llama3-8b-h200"
    rows = run_tables.rows(doc["runs"])
    printed = "\n\n".join(t.render(rows, legend=False) for t in RESULT_TABLES)
    assert readme_results() == printed.split("\n")
