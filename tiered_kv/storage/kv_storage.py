"""KVStorage: one tensor per tier, allocated once, with zero-copy per-layer views.

Layouts:

* ``block_contiguous`` (default): ``[num_blocks, num_layers, 2, block_size, heads, head_dim]``.
  A block is one contiguous region holding every layer's K and V, so a run of
  consecutive blocks is a single copy.
* ``layer_first``: ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``, i.e.
  per-layer K and V tensors ``[num_blocks, block_size, heads, head_dim]`` as
  attention kernels take them; a run is ``2 * num_layers`` copies.

``layer_kv(layer)`` returns ``(K, V)`` views of shape
``[num_blocks, block_size, heads, head_dim]`` in both layouts, without copying.
"""

from __future__ import annotations

import os

import torch

from tiered_kv.errors import StorageError
from tiered_kv.storage.spec import LAYOUTS, KVSpec

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        TORCH_DTYPES[_name] = getattr(torch, _name)

CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # device-visible through unified addressing


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (or free physical pages where that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVStorage:
    """The KV bytes of one tier.

    Args:
        spec: KV geometry.
        num_blocks: Blocks in the tier (block 0, the null block, included).
        medium: ``"GPU"`` or ``"CPU"``.
        layout: ``"block_contiguous"`` or ``"layer_first"``.
        device: Where the GPU tier lives; default CUDA when present, else CPU memory.
        pin: Pin the CPU tier (default: when CUDA is present).

    Raises:
        StorageError: the tier does not fit in free memory, or pinning failed.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        medium: str = "GPU",
        layout: str = "block_contiguous",
        device: str | torch.device | None = None,
        pin: bool | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise StorageError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise StorageError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
        if spec.dtype not in TORCH_DTYPES:
            raise StorageError(f"dtype {spec.dtype} is not available in this torch build")
        self.spec = spec
        self.num_blocks = num_blocks
        self.medium = medium
        self.layout = layout
        cuda = torch.cuda.is_available()
        if device is None:
            device = "cuda" if (medium == "GPU" and cuda) else "cpu"
        self.device = torch.device(device)
        self.nbytes = num_blocks * spec.bytes_per_block
        self._check_fits()
        dims = (spec.block_size, spec.num_kv_heads, spec.head_dim)
        shape = (
            (num_blocks, spec.num_layers, 2, *dims)
            if layout == "block_contiguous"
            else (spec.num_layers, 2, num_blocks, *dims)
        )
        dtype = TORCH_DTYPES[spec.dtype]
        self._registered: list[tuple[int, int]] = []
        try:
            self.kv = torch.empty(shape, dtype=dtype, device=self.device)
        except RuntimeError as exc:  # torch raises RuntimeError (OutOfMemoryError) on failure
            raise StorageError(f"{medium} tier: allocating {self.nbytes / 2**30:.2f} GiB failed: {exc}") from exc
        self.pinned = False
        if pin is None:
            pin = medium == "CPU" and cuda and self.device.type == "cpu"
        if pin:
            self._pin()

    def _check_fits(self) -> None:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = available_host_bytes()
        if self.nbytes > free:
            raise StorageError(
                f"{self.medium} tier of {self.num_blocks} blocks x {self.spec.bytes_per_block} bytes needs "
                f"{self.nbytes / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free on {self.device}"
            )

    def _pin(self) -> None:
        """Page-lock the whole CPU tier with one cudaHostRegister; fail loudly.

        One registration, never several side by side: a copy whose host range
        crosses from one registration into the next is refused by CUDA
        (``cudaErrorInvalidValue``), and a layer-first run spans the whole tier.
        Measured on an H200: with 1 GiB registrations every copy over a 1 GiB
        boundary failed.
        """
        if not torch.cuda.is_available():
            raise StorageError("cannot pin the CPU tier: CUDA is not available")
        cudart = torch.cuda.cudart()
        base = self.kv.data_ptr()
        err = cudart.cudaHostRegister(base, self.nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        code = int(getattr(err, "value", err))
        if code != 0:
            raise StorageError(
                f"pinning the CPU tier ({self.nbytes} bytes) failed (cudaHostRegister error {code}); "
                "raise the locked-memory limit (ulimit -l) or use a smaller CPU tier"
            )
        self._registered.append((base, self.nbytes))
        self.pinned = True

    def close(self) -> None:
        """Unregister the pinned tier (the tensor itself is freed with the object)."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr, _ in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered = []
            self.pinned = False

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass

    # ----------------------------------------------------------------- views
    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy ``(K, V)`` views of one layer: ``[num_blocks, block_size, heads, head_dim]``."""
        if self.layout == "block_contiguous":
            return self.kv[:, layer, 0], self.kv[:, layer, 1]
        return self.kv[layer, 0], self.kv[layer, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """One block's data as ``[num_layers, 2, block_size, heads, head_dim]`` (a copy in layer-first)."""
        if self.layout == "block_contiguous":
            return self.kv[block_id]
        return self.kv[:, :, block_id]

    def run_view(self, start: int, length: int) -> torch.Tensor:
        """Blocks ``[start, start+length)``: one contiguous region (block-contiguous) or a strided view."""
        if self.layout == "block_contiguous":
            return self.kv[start : start + length]
        return self.kv[:, :, start : start + length]

    def run_segments(self, start: int, length: int) -> list[torch.Tensor]:
        """The contiguous pieces of a run: 1 (block-contiguous) or ``2 * num_layers`` (layer-first)."""
        if self.layout == "block_contiguous":
            return [self.kv[start : start + length]]
        return [self.kv[layer, kv, start : start + length] for layer in range(self.spec.num_layers) for kv in (0, 1)]

    def byte_view(self) -> torch.Tensor:
        """The whole tier as a flat uint8 tensor (a cached view: slicing it is the cheapest copy source)."""
        bv = self.__dict__.get("_byte_view")
        if bv is None:
            bv = self._byte_view = self.kv.view(-1).view(torch.uint8)
        return bv
