"""The dtype a run computes in, named without importing torch (the launcher plans with it;
``workers.engines.base.resolve_dtype`` makes the torch dtype of the same name)."""

from __future__ import annotations

from yatt.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
"""What ``model.dtype`` may name besides ``auto``."""


def cpu_has_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (AMX tiles or AVX512-BF16): there bf16
    matmuls run ~10x faster than float32 (measured on this project's CI machine)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def compute_dtype_name(dtype: str, device_type: str) -> str:
    """The compute dtype ``model.dtype`` names on a device of ``device_type`` (torch's
    ``device.type``): ``auto`` is bfloat16 on GPU and on a CPU with native bf16
    (``cpu_has_bf16``), else float32."""
    if dtype == "auto":
        return "bfloat16" if device_type != "cpu" or cpu_has_bf16() else "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be auto, float32, bfloat16 or float16 (got {dtype!r})")
    return dtype
