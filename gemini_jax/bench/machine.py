"""What machine a run was on, and its measured memory bandwidth."""

from __future__ import annotations

import os
import platform
import subprocess
import time

import numpy as np

from gemini_jax.bench.timing import median


def _cpuinfo() -> dict:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = val.strip()
                elif key == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return {"cpu_model": model, "simd": simd}


def _meminfo_gib() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = round(int(v.split()[0]) / 2**20, 1)
    except OSError:
        pass
    return {"ram_total_gib": out.get("MemTotal"), "ram_available_gib": out.get("MemAvailable")}


def _l3_cache() -> str | None:
    try:
        for idx in sorted(os.listdir("/sys/devices/system/cpu/cpu0/cache")):
            base = f"/sys/devices/system/cpu/cpu0/cache/{idx}"
            if open(f"{base}/level").read().strip() == "3":
                return open(f"{base}/size").read().strip()
    except OSError:
        pass
    return None


def _git() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gemini_jax"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"git_commit": rev or None, "gemini_jax_dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "gemini_jax_dirty": None}


def describe_machine() -> dict:
    import jax

    d = {**_cpuinfo(), "logical_cpus": os.cpu_count(),
         "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
         "l3_cache": _l3_cache(), **_meminfo_gib(),
         "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
         "python": platform.python_version(), "platform": platform.platform(),
         "jax": jax.__version__, "jax_backend": jax.default_backend(),
         "jax_devices": [str(x) for x in jax.devices()], "numpy": np.__version__, **_git()}
    try:
        import flax
        d["flax"] = flax.__version__
    except ImportError:
        pass
    try:
        import torch
        import transformers
        d.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                 transformers=transformers.__version__)
    except ImportError:
        pass
    return d


def measure_bandwidth(mib: int, repeats: int) -> dict:
    """Memory bandwidth of this machine, two ways, median of `repeats` each (interleaved):

    * `jax_sum_read_gbs`: a jitted `jnp.sum` over a float32 array of `mib` MiB (far above L3),
      counting the array's bytes once (a pure streaming read in XLA's CPU runtime, the runtime
      our decode step runs in). This is the reference for KV-read bounds.
    * `numpy_copy_gbs`: `np.copyto(dst, src)` of `mib` MiB, counting read + write
      (2 x size; single-threaded, so a lower bound on what the machine can do).
    """
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    x = jnp.asarray(src)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()  # compile
    np.copyto(dst, src)  # fault the pages in
    t_sum, t_copy = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        t_sum.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t_copy.append(time.perf_counter() - t0)
    size = n * 4
    read = size / median(t_sum) / 1e9
    copy = 2 * size / median(t_copy) / 1e9
    return {
        "array_mib": mib, "repeats": repeats,
        "jax_sum_read_gbs": round(read, 2), "numpy_copy_gbs": round(copy, 2),
        "reference_gbs": round(read, 2), "reference": "jax_sum_read_gbs",
        "method": (f"median of {repeats} interleaved repeats on one float32 array of {mib} MiB "
                   f"(above L3): jitted jnp.sum (bytes read = array size) and np.copyto into a "
                   f"preallocated array (bytes = 2 x size, read + write, one thread). The reference "
                   f"for bandwidth bounds is the jnp.sum read figure."),
    }
