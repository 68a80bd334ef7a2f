"""What a trace offers: request counts, rates, length percentiles, and prefix reuse against cache capacity.

Reuse is measured as a prefix cache would see it: requests in arrival order,
each looking up its prompt's blocks from the first one and stopping at the
first miss, then holding all of them (most recently used last); a cache of ``C``
tokens evicts least recently used blocks until the blocks it holds fit.  The
*hit rate* is the fraction of all prompt tokens found this way.  Blocks are the
trace's own: its prefix hashes (512 tokens each for Mooncake, the last one
partial), or chained hashes of 16 token ids for a trace with token ids.  A
trace with only lengths (Azure, BurstGPT) says nothing about sharing, so its
reuse is not defined (``None``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

# Capacities of the reuse curve, in tokens: 10^4 .. 10^9 in half decades (the trace paper's axis).
CURVE_TOKENS = tuple(round(10 ** (4 + k / 2)) for k in range(11))
TOKEN_BLOCK = 16  # block size for traces given as token ids


def prompt_blocks(
    prompt_len: int, hashes: Sequence[int] | None, hash_block_size: int, tokens: Sequence[int] | None
) -> list[tuple[Hashable, int]] | None:
    """The prompt's blocks as (key, tokens) pairs, or None when the trace says nothing about sharing."""
    if hashes is not None:
        out: list[tuple[Hashable, int]] = []
        for j, h in enumerate(hashes):
            out.append((h, min(hash_block_size, prompt_len - j * hash_block_size)))
        return out
    if tokens is None:
        return None
    keys: list[tuple[Hashable, int]] = []
    parent: int = 0
    for s in range(0, len(tokens) - TOKEN_BLOCK + 1, TOKEN_BLOCK):
        parent = hash((parent, *tokens[s : s + TOKEN_BLOCK]))
        keys.append((("t", parent), TOKEN_BLOCK))
    return keys


def hit_rates(requests: Iterable[tuple[int, list[tuple[Hashable, int]]]], capacities: Sequence[float]) -> list[float]:
    """Prefix hit rate (hit prompt tokens / all prompt tokens) for each capacity in tokens (``math.inf``: unbounded).

    ``requests`` are (prompt tokens, blocks) in arrival order.
    """
    reqs = list(requests)
    total = sum(n for n, _ in reqs)
    out = []
    for cap in capacities:
        hits = 0
        if math.isinf(cap):
            seen: set[Hashable] = set()
            for _, blocks in reqs:
                for key, n in blocks:
                    if key not in seen:
                        break
                    hits += n
                seen.update(k for k, _ in blocks)
        else:
            lru: OrderedDict[Hashable, int] = OrderedDict()
            held = 0
            for _, blocks in reqs:
                hitting = True
                for key, n in blocks:
                    if hitting and key in lru:
                        hits += n
                    else:
                        hitting = False
                    if key in lru:
                        lru.move_to_end(key)
                    else:
                        lru[key] = n
                        held += n
                while held > cap and lru:
                    _, n = lru.popitem(last=False)
                    held -= n
        out.append(hits / total if total else 0.0)
    return out


def mean_rate(arrivals: Sequence[float]) -> float:
    """Requests per second over a trace's span: (requests - 1) / (last arrival - first arrival); 0 without a span.

    The count between the first arrival and the last is one less than the
    requests (the first opens the span), so ``n`` evenly spaced requests ``1 / r``
    apart have rate exactly ``r``.
    """
    if len(arrivals) < 2:
        return 0.0
    span = max(arrivals) - min(arrivals)
    return (len(arrivals) - 1) / span if span > 0 else 0.0


def _pct(xs: list[int], q: float) -> float:
    if not xs:
        return 0.0
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _lengths(xs: list[int]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "mean": sum(s) / len(s) if s else 0.0,
        "p50": _pct(s, 50),
        "p90": _pct(s, 90),
        "p99": _pct(s, 99),
        "max": float(s[-1]) if s else 0.0,
    }


def summary(rows: Sequence[Any], capacities: Sequence[float] = (*CURVE_TOKENS, math.inf)) -> dict[str, Any]:
    """Counts, rate, length percentiles and reuse of trace rows (:class:`~tiered_kv.sim.trace_formats.TraceRow`)."""
    arrivals = [r.arrival for r in rows]
    span = max(arrivals) - min(arrivals) if rows else 0.0
    blocks = [prompt_blocks(r.prompt_len, r.hash_ids, r.hash_block_size, r.prompt_tokens) for r in rows]
    known = all(b is not None for b in blocks)
    reuse = (
        dict(zip(map(str, capacities), hit_rates(((r.prompt_len, b) for r, b in zip(rows, blocks, strict=True)
                                                     if b is not None), capacities), strict=True))
        if known
        else None
    )  # fmt: skip
    convs = {r.conversation for r in rows if r.conversation >= 0}
    return {
        "requests": len(rows),
        "conversations": len(convs) + sum(1 for r in rows if r.conversation < 0),
        "duration_s": span,
        "rate_rps": mean_rate(arrivals),
        "input_tokens": _lengths([r.prompt_len for r in rows]),
        "output_tokens": _lengths([r.output_len for r in rows]),
        "prompt_tokens_total": sum(r.prompt_len for r in rows),
        "reuse": reuse,
    }


def _tokens_label(cap: str) -> str:
    if cap == "inf":
        return "unbounded"
    v = float(cap)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}"


def text(doc: dict[str, Any], name: str) -> str:
    """The summary as ``trace inspect`` prints it."""
    i, o = doc["input_tokens"], doc["output_tokens"]
    lines = [
        f"{name}: {doc['requests']} requests in {doc['conversations']} conversations over "
        f"{doc['duration_s']:.0f} s ({doc['rate_rps']:.2f} requests/s)",
        f"  input tokens:  mean {i['mean']:.0f}, p50 {i['p50']:.0f}, p90 {i['p90']:.0f}, p99 {i['p99']:.0f}, "
        f"max {i['max']:.0f}",
        f"  output tokens: mean {o['mean']:.1f}, p50 {o['p50']:.0f}, p90 {o['p90']:.0f}, p99 {o['p99']:.0f}, "
        f"max {o['max']:.0f}",
    ]
    if doc["reuse"] is None:
        lines.append("  prefix reuse: not known (the format carries no token ids or prefix hashes)")
    else:
        pts = ", ".join(f"{_tokens_label(k)} {v:.1%}" for k, v in doc["reuse"].items())
        lines.append(f"  prefix hit rate by cache capacity (tokens, LRU): {pts}")
    return "\n".join(lines)
