"""Facts about the machine a result was measured on: platform, CPU (model, vendor, family, cores,
instruction-set flags), memory, Python and JAX versions, and the date; ``facts()`` has them all
(every JSON written by ``results.write_json`` carries it as "host"), the rest are the shorter forms
the scripts' own "machine" fields have always had."""
from __future__ import annotations

import datetime
import os
import platform
import sys

ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16",
             "i8mm")
"""The /proc/cpuinfo flags that decide which kernel paths a CPU runs (x86 SIMD and AMX, Arm NEON/SVE)."""


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in block.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in fields}


def processor() -> str:
    """``platform.processor()``, or the machine type where that is empty."""
    return platform.processor() or platform.machine()


def cpu() -> dict:
    """The CPU: model, vendor, family, cores (logical, as ``os.cpu_count``) and ``ISA_FLAGS`` it has."""
    info = cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    return {"model": info.get("model name") or platform.processor() or "unknown CPU",
            "vendor": info.get("vendor_id") or info.get("CPU implementer"),
            "family": info.get("cpu family") or info.get("CPU architecture"), "cores": os.cpu_count(),
            "isa_flags": [flag for flag in ISA_FLAGS if flag in flags]}


def memory_bytes() -> int | None:
    """Physical memory (MemTotal in /proc/meminfo; None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None


def platform_facts(with_jax: bool = False) -> dict:
    """{platform, processor, cpus, python} and, ``with_jax``, the jax version and the first device."""
    out = {"platform": platform.platform(), "processor": processor(), "cpus": os.cpu_count(),
           "python": platform.python_version()}
    if with_jax:
        import jax

        out |= {"jax": jax.__version__, "device": str(jax.devices()[0])}
    return out


def facts() -> dict:
    """Every fact: ``platform_facts``, the CPU, memory, the load average and, where this process
    has imported JAX, its versions (nothing here imports it)."""
    out = {**platform_facts(), "cpu": cpu(), "memory_bytes": memory_bytes(), "load_average": os.getloadavg()}
    if (jax := sys.modules.get("jax")) is not None:
        out |= {"jax": jax.__version__, "jaxlib": getattr(getattr(jax, "lib", None), "__version__", None)}
    return out


def summary(with_processor: bool = False) -> str:
    """``"N-core x86_64, Python 3.12.3"`` (``with_processor``: ``processor()`` for the machine type)."""
    return (f"{os.cpu_count()}-core {processor() if with_processor else platform.machine()}, "
            f"Python {platform.python_version()}")


def describe() -> str:
    """One line: the GPU's kind and jax where JAX runs on one, else cores, CPU model, Python and jax."""
    import jax

    if jax.default_backend() == "gpu":
        return f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    return f"{os.cpu_count()}-core {cpu()['model']}, Python {platform.python_version()}, jax {jax.__version__}"


def today() -> str:
    """The date, ISO (``2026-01-31``)."""
    return datetime.date.today().isoformat()


def now(timespec: str = "seconds", utc: bool = False) -> str:
    """The local (``utc``: UTC, with its offset) date and time, ISO, to ``timespec``."""
    return datetime.datetime.now(datetime.UTC if utc else None).isoformat(timespec=timespec)
