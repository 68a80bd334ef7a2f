"""gpu-check's device facts: what the numbers were measured on.

GPU name, memory, compute capability and multiprocessors from torch; driver,
PCIe generation and width from ``nvidia-smi`` (or NVML through ``pynvml``
when the binary is missing); CUDA versions from torch and cupy; the host's
processor, cores and memory.  A fact that cannot be read here is recorded as
``None`` with the reason under ``unavailable``, never guessed.

The PCIe link's *current* generation can read lower at idle (power saving);
both the current and the maximum are kept, and the bandwidth part reads them
again while it is running copies.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import Any

import torch

from tiered_kv.storage.kv_storage import available_host_bytes

PCIE_FIELDS = ("pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max")
SMI_FIELDS = ("name", "driver_version", *PCIE_FIELDS, "memory.total", "clocks.max.sm")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def nvidia_smi(fields: tuple[str, ...] = SMI_FIELDS, timeout: float = 10.0) -> dict[str, str] | str:
    """``nvidia-smi --query-gpu`` of GPU 0 as ``{field: value}``, or why it could not be read."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi is not on the PATH"
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "--id=0"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        return f"nvidia-smi failed: {' '.join(str(exc).split())}"
    values = [v.strip() for v in out.strip().split(",")]
    if len(values) != len(fields):
        return f"nvidia-smi answered {out.strip()!r}"
    return dict(zip(fields, values, strict=True))


def _nvml_pcie() -> dict[str, Any] | str:
    try:
        import pynvml
    except ImportError:
        return "pynvml is not installed"
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        facts = {
            "pcie.link.gen.current": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
            "pcie.link.gen.max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
            "pcie.link.width.current": pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
            "pcie.link.width.max": pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            "driver_version": pynvml.nvmlSystemGetDriverVersion(),
        }
        pynvml.nvmlShutdown()
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in facts.items()}
    except Exception as exc:  # NVML raises its own error types
        return f"NVML failed: {' '.join(str(exc).split())}"


def _number(v: Any) -> int | float | str | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return int(f) if f.is_integer() else f


def pcie_link() -> dict[str, Any]:
    """Current and maximum PCIe generation and width of GPU 0 (``None`` where unreadable, with why)."""
    smi = nvidia_smi(PCIE_FIELDS)
    src: dict[str, Any] | str = smi if isinstance(smi, dict) else _nvml_pcie()
    if isinstance(src, str):
        reason = src if isinstance(smi, dict) else f"{smi}; {src}"
        return {"gen_current": None, "gen_max": None, "width_current": None, "width_max": None, "unavailable": reason}
    return {
        "gen_current": _number(src.get("pcie.link.gen.current")),
        "gen_max": _number(src.get("pcie.link.gen.max")),
        "width_current": _number(src.get("pcie.link.width.current")),
        "width_max": _number(src.get("pcie.link.width.max")),
        "source": "nvidia-smi" if isinstance(smi, dict) else "NVML",
    }


def cupy_facts() -> dict[str, Any]:
    try:
        import cupy
    except Exception as exc:
        return {"version": None, "unavailable": f"cupy is not importable ({type(exc).__name__})"}
    facts: dict[str, Any] = {"version": cupy.__version__}
    try:
        facts["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        facts["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:
        facts["unavailable"] = f"cupy sees no CUDA ({' '.join(str(exc).split())})"
    return facts


def device_facts() -> dict[str, Any]:
    """Everything above, as one JSON-ready mapping."""
    facts: dict[str, Any] = {
        "host": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "memory_available_bytes": available_host_bytes(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": False},
        "cupy": cupy_facts(),
    }
    if not torch.cuda.is_available():
        facts["gpu"] = None
        facts["unavailable"] = "torch sees no CUDA device"
        return facts
    props = torch.cuda.get_device_properties(0)
    facts["torch"]["cuda_available"] = True
    facts["torch"]["cudnn"] = torch.backends.cudnn.version()
    facts["gpu"] = {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "device_count": torch.cuda.device_count(),
    }
    smi = nvidia_smi()
    if isinstance(smi, dict):
        facts["gpu"]["driver"] = smi.get("driver_version")
        facts["gpu"]["max_sm_clock_mhz"] = _number(smi.get("clocks.max.sm"))
    else:
        nv = _nvml_pcie()
        facts["gpu"]["driver"] = nv.get("driver_version") if isinstance(nv, dict) else None
        facts["gpu"]["driver_unavailable"] = smi if not isinstance(nv, dict) else None
    facts["pcie"] = pcie_link()
    return facts


def hardware_line(facts: dict[str, Any]) -> str:
    """One line naming the machine, for tables and ``docs/gpu.md``."""
    t = facts["torch"]
    if facts.get("gpu") is None:
        return f"no GPU; CPU {facts['host']['cpu']} ({facts['host']['cores']} cores); torch {t['version']}"
    g = facts["gpu"]
    p = facts.get("pcie", {})
    link = (
        f"PCIe gen {p.get('gen_current')}/{p.get('gen_max')} x{p.get('width_current')}/{p.get('width_max')} "
        "(current/max)"
        if p.get("gen_max") is not None
        else "PCIe unknown"
    )
    cupy = facts["cupy"].get("version") or "no cupy"
    return (
        f"{g['name']} ({g['memory_bytes'] / 2**30:.0f} GiB, sm {g['compute_capability']}), driver {g.get('driver')}, "
        f"{link}; torch {t['version']} (CUDA {t['cuda']}), cupy {cupy}; host {facts['host']['cpu']}"
    )
