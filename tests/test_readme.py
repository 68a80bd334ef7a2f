"""The README's Python examples run as written (with the tier sizes scaled down)."""

import pathlib
import re


def test_readme_python_examples_run():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    for code in blocks:
        # Keep the example's shape but not its 10 GiB of tiers.
        code = (
            code.replace("KVStorage(LLAMA3_8B, 1024", "KVStorage(LLAMA3_8B, 32")
            .replace("KVStorage(LLAMA3_8B, 4096", "KVStorage(LLAMA3_8B, 64")
            .replace("TierManager(1024, 4096", "TierManager(32, 64")
        )
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)
    # The scheduler loop served every request, preempting on the way.
    assert sorted(namespace["done"]) == [0, 1, 2, 3, 4]
    assert namespace["tm"].metrics().counters.preemptions_swap > 0
