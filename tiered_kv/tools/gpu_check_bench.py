"""gpu-check's overlap bench: a Llama-shaped model, its paged KV and the swap tiers, built once for every scenario."""

from __future__ import annotations

import torch

from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tools.crossover_model import LlamaShape, RandomLlama
from tiered_kv.transfer.plan import PlanKind, TransferPlan


class OverlapBench:
    """The model, the tiers and the engines of the overlap part."""

    def __init__(
        self,
        shape: LlamaShape,
        kv: KVSpec,
        compute_tokens: int,
        overlap_mib: int,
        layerwise_context: int,
        layerwise_chunk: int,
        block_size: int,
        device: str,
        repeats: int,
    ) -> None:
        self.device = device
        self.cuda = torch.device(device).type == "cuda"
        self.repeats = repeats
        self.bs = block_size
        self.model = RandomLlama(shape, device)
        # The compute model's own cache (layer-first: one layer's K/V of a run of blocks is contiguous).
        mspec = shape.kv_spec(block_size)
        self.ctx_blocks = -(-layerwise_context // block_size)
        req_blocks = -(-(layerwise_context + layerwise_chunk) // block_size)
        fwd_blocks = -(-compute_tokens // block_size)
        self.model_tiers = {
            "GPU": KVStorage(mspec, 1 + req_blocks + fwd_blocks, "GPU", "layer_first", device=device),
            "CPU": KVStorage(mspec, 1 + self.ctx_blocks, "CPU", "layer_first"),
        }
        self.req_table = list(range(1, 1 + req_blocks))
        fwd_table = list(range(1 + req_blocks, 1 + req_blocks + fwd_blocks))
        self.forward_batch = self.model.prepare([fwd_table], 0, compute_tokens, block_size)
        self.chunk_batch = self.model.prepare([self.req_table], layerwise_context, layerwise_chunk, block_size)
        # The swaps' tiers: the KV shape under test, half of each tier per direction.
        spec = kv.with_block_size(block_size)
        self.n = max((overlap_mib << 20) // spec.bytes_per_block, 1)
        self.swap_tiers = {
            "GPU": KVStorage(spec, 2 * self.n + 1, "GPU", "block_contiguous", device=device),
            "CPU": KVStorage(spec, 2 * self.n + 1, "CPU", "block_contiguous"),
        }
        for tiers in (self.model_tiers, self.swap_tiers):
            for t in tiers.values():
                t.byte_view().fill_(0)
        self.swap_bytes = 2 * self.n * spec.bytes_per_block
        self.layer_bytes = 2 * self.ctx_blocks * mspec.segment_bytes
        self.next_id = 0
        self.side = torch.cuda.Stream() if self.cuda else None

    def next_plan_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def swap_plans(self) -> list[TransferPlan]:
        out_ids = tuple(range(1, self.n + 1))
        in_ids = tuple(range(self.n + 1, 2 * self.n + 1))
        return [
            TransferPlan(self.next_plan_id(), "GPU", "CPU", out_ids, out_ids, PlanKind.SWAP_OUT),
            TransferPlan(self.next_plan_id(), "CPU", "GPU", in_ids, in_ids, PlanKind.SWAP_IN, urgent=True),
        ]

    def forward(self, times: int) -> None:
        for _ in range(times):
            self.model.forward(self.forward_batch, self.model_tiers["GPU"])

    def close(self) -> None:
        for tiers in (self.model_tiers, self.swap_tiers):
            for t in tiers.values():
                t.close()
