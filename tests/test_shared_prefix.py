"""The shared-prefix workload kind: recycled prompts at constant-rate stages, as inference-perf sends them."""

import pytest
from simutil import config, run

from tiered_kv.errors import ConfigError
from tiered_kv.sim import shared_prefix
from tiered_kv.sim.workload import generate, longest_synthetic, size

SPEC = {
    "systems": 2,
    "users_per_system": 2,
    "system_len": 3,
    "question_len": 2,
    "output_len": 2,
    "stages": [[1, 3], [2, 1]],
}


def test_prompts_recur_in_order_and_arrivals_are_one_over_the_rate_apart_stage_after_stage():
    reqs = generate(config(workload__shared_prefix=SPEC)["workload"], 0)
    # Stage 0: 1 req/s for 3 s (three requests at 0, 1, 2); stage 1: 2 req/s for 1 s (at 3, 3.5).
    assert [r.arrival for r in reqs] == [0.0, 1.0, 2.0, 3.0, 3.5]
    # Four prompts: system prompt p // 2 (ids 1-3, 4-6) and a question of its own (7-8, 9-10, 11-12,
    # 13-14); request j sends prompt j mod 4, and every answer is fresh ids (15-16, ...), exactly 2.
    assert [list(r.prompt) for r in reqs] == [
        [1, 2, 3, 7, 8],
        [1, 2, 3, 9, 10],
        [4, 5, 6, 11, 12],
        [4, 5, 6, 13, 14],
        [1, 2, 3, 7, 8],
    ]
    assert [list(r.output) for r in reqs] == [[15, 16], [17, 18], [19, 20], [21, 22], [23, 24]]
    assert reqs[4].prompt is reqs[0].prompt  # one token list per prompt
    assert [shared_prefix.stage_of(r.arrival, [(1.0, 3.0), (2.0, 1.0)]) for r in reqs] == [0, 0, 0, 1, 1]


def test_its_size_is_known_before_it_is_built():
    w = config(workload__shared_prefix=SPEC)["workload"]
    assert longest_synthetic(w) == 7
    s = size(w)
    assert (s.requests, s.tokens, s.longest, s.longest_key) == (5, 35, 7, "workload.shared_prefix")


def test_a_recurring_prompt_finds_its_blocks_cached():
    # TINY: 4-token blocks.  A prompt of 3 + 5 = 8 tokens is two full blocks; sent again, it hits the
    # first only: as in vLLM, at most num_tokens - 1 tokens may come from the cache (the last token must
    # be computed to sample), and hits are whole blocks, so 4 of the 8 tokens are computed again.
    spec = dict(SPEC, systems=1, users_per_system=1, system_len=3, question_len=5, stages=[[0.1, 20]])
    res, sim = run(config(workload__shared_prefix=spec, memory__gpu_kv_gib=64 * 1024 / 2**30), trace=True)
    steps = [e[2] for e in sim.loop.trace if e[1] == "step"]
    assert steps[0] == ((0, 8),) and steps[2] == ((1, 4),)
    assert res["gpu_prefix_hit_rate"] > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stages": []}, r"workload\.shared_prefix\.stages: must list at least one \[rate, duration\] stage"),
        ({"stages": [[0, 10]]}, r"workload\.shared_prefix\.stages\[0\]: must be \[rate in requests/s > 0"),
        ({"stages": [[1, 10, 3]]}, r"workload\.shared_prefix\.stages\[0\]: must be"),
        ({"stages": [[1, True]]}, r"workload\.shared_prefix\.stages\[0\]: must be"),
        ({"output_len": 0}, r"workload\.shared_prefix\.output_len: must be > 0"),
        ({"systems": 1.5}, r"workload\.shared_prefix\.systems: expected an integer"),
        ({"extra": 1}, r"workload\.shared_prefix\.extra: unknown key"),
    ],
)
def test_bad_specs_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        config(workload__shared_prefix=dict(SPEC, **change))


def test_a_trace_and_shared_prefixes_are_not_both_a_workload(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival": 0, "prompt_len": 4, "output_len": 2}\n')
    with pytest.raises(ConfigError, match=r"workload\.shared_prefix: a workload is a trace or shared prefixes"):
        config(workload__shared_prefix=SPEC, workload__trace=str(p))
