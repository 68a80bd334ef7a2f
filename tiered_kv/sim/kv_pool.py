"""The GPU KV pool as vLLM's worker sizes it: what ``gpu_memory_utilization`` leaves for KV.

vLLM's ``Worker.determine_available_memory`` (``vllm/v1/worker/gpu_worker.py``)
runs one forward pass of ``max_num_batched_tokens`` dummy tokens and the
sampler over ``max_num_seqs`` rows (``GPUModelRunner.profile_run``: the dummy
run's ``num_reqs = min(num_tokens, max_num_seqs)``), under
``memory_profiling`` (``vllm/utils/mem_utils.py``), and gives the KV cache::

    requested = total memory (cudaMemGetInfo) x gpu_memory_utilization
    KV        = requested - weights - torch peak of the profile run
                - memory outside torch (NCCL, cuBLAS and attention workspaces)
                - CUDA graphs' estimate (vLLM 0.21.0 and later only)

and the pool is ``KV // (block_size x KV bytes per token per GPU)`` blocks.
The CUDA context predates the profile's baseline, so it sits in the memory
``gpu_memory_utilization`` leaves over and is not taken here.

The terms, per GPU (the profile runs on every rank alike):

* **weights**: every parameter over the tensor-parallel degree, in the
  weights' dtype (:attr:`ModelProfile.weight_bytes_per_gpu`);
* **the forward pass's peak**: :data:`ACTIVATION_FACTOR` of
  ``max_num_batched_tokens x (2 x intermediate / TP + hidden)`` elements of
  the activation dtype: the gated MLP's gate-and-up output and a hidden state
  per token, the largest tensors alive at once in a step;
* **the sampler's peak**: :data:`SAMPLER_BYTES` per element of its
  ``max_num_seqs x vocabulary`` logits (float32 logits, top-k/top-p's sort
  values and int64 indices, softmax and cumulative sum, each a full copy);
* **memory outside torch**: :data:`NON_TORCH_GIB` on one GPU, and more with
  tensor parallelism (NCCL's buffers, the custom all-reduce's IPC buffers);
* **CUDA graphs** (0.21.0 and later): ``memory.cudagraph_gib`` of the config,
  default :data:`CUDAGRAPH_GIB`.

Only the structure comes from vLLM's code: the three constants of the forward
pass, the sampler and the memory outside torch were fitted here to the GPU
block counts vLLM 0.15.1 logged for eight H100 runs of five models at TP 1, 2
and 4 (``configs/validation/vllm-0.15.1-h100-runs.yaml``; least squares on the
GiB each count leaves after the weights; docs/validation.md): every count is
then within 0.6% (``tests/test_kv_pool.py``).  The same numbers apply to every
GPU (they are sizes of tensors, not speeds).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv.errors import ConfigError
from tiered_kv.sim.engine_version import EngineVersion
from tiered_kv.sim.profiles import HardwareProfile, ModelProfile

GIB = 1 << 30
#: Of ``max_num_batched_tokens x (2 x intermediate / TP + hidden)`` activation elements: the forward pass's peak.
ACTIVATION_FACTOR = 0.71
#: Bytes per element of the sampler's ``max_num_seqs x vocabulary`` logits at its peak.
SAMPLER_BYTES = 50.0
#: Memory outside torch that the profile counts, GiB: one GPU, and tensor-parallel (NCCL, custom all-reduce).
NON_TORCH_GIB = {1: 0.32, 2: 0.54}
#: vLLM 0.21.0 and later: the CUDA graphs' estimate taken from the KV budget, GiB, when the config gives none.
#: Published logs of vLLM's own estimate: 0.17 GiB (noonghunna/club-3090 issue #127: gpu_memory_utilization
#: 0.92 "is equivalent to 0.9129 without CUDA graph memory profiling", 24 GiB GPUs, TP 4) and 0.36 GiB
#: (gpustack/runner PR #251: 0.82 against 0.8048, TP 2): their mean, rounded up.
CUDAGRAPH_GIB = 0.3


@dataclass(frozen=True, slots=True)
class KVBudget:
    """Where one GPU's memory goes, in GiB (module docstring); ``kv_gib`` is what the pool gets."""

    requested_gib: float
    weights_gib: float
    activation_gib: float
    sampler_gib: float
    non_torch_gib: float
    cudagraph_gib: float

    @property
    def kv_gib(self) -> float:
        return (
            self.requested_gib
            - self.weights_gib
            - self.activation_gib
            - self.sampler_gib
            - self.non_torch_gib
            - self.cudagraph_gib
        )

    def describe(self) -> str:
        return (
            f"{self.requested_gib:.2f} GiB requested - {self.weights_gib:.2f} weights - {self.activation_gib:.2f} "
            f"activations - {self.sampler_gib:.2f} sampler - {self.non_torch_gib:.2f} outside torch"
            + (f" - {self.cudagraph_gib:.2f} CUDA graphs" if self.cudagraph_gib else "")
            + f" = {self.kv_gib:.2f} GiB of KV"
        )


def vllm_kv_budget(
    hw: HardwareProfile,
    model: ModelProfile,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    engine: EngineVersion,
    cudagraph_gib: float | None = None,
) -> KVBudget:
    """The KV memory of one GPU as the engine's memory profile gives it (module docstring)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"memory.gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    tp = model.tensor_parallel
    act_elems = max_num_batched_tokens * (2 * model.intermediate_size / tp + model.hidden_size)
    graphs = 0.0
    if engine.cudagraph_memory_in_budget:
        graphs = CUDAGRAPH_GIB if cudagraph_gib is None else cudagraph_gib
    return KVBudget(
        requested_gib=hw.memory_gib * gpu_memory_utilization,
        weights_gib=model.weight_bytes_per_gpu / GIB,
        activation_gib=ACTIVATION_FACTOR * act_elems * model.dtype_bytes / GIB,
        sampler_gib=SAMPLER_BYTES * min(max_num_seqs, max_num_batched_tokens) * model.vocab_size / GIB,
        non_torch_gib=NON_TORCH_GIB[1 if tp == 1 else 2],
        cudagraph_gib=graphs,
    )


def num_blocks(kv_gib: float, block_size: int, model: ModelProfile) -> int:
    """Blocks of ``block_size`` tokens that ``kv_gib`` holds (vLLM floors the division)."""
    return int(kv_gib * GIB // (block_size * model.kv_bytes_per_token))
