"""The two forms of gpu-check: the real one for a GPU, and a small one that runs the same code on a CPU.

Every size and time budget lives here.  The GPU form is sized to finish in
under 8 minutes on one H200 (its parts' budgets add up to 440 s, and a hard
limit ends the command at about 470 s whatever happens); the CPU form runs every
code path with tiny shapes in under a minute on two cores, so CI keeps it from
rotting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tiered_kv.storage.spec import LLAMA3_8B, KVSpec
from tiered_kv.tools.crossover_model import LLAMA3_8B_SHAPE, SMALL_SHAPE, LlamaShape

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
