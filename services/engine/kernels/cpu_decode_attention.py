"""Paged decode attention for the CPU, as a small C++/OpenMP kernel compiled on first use.

The torch reference gathers every sequence's KV blocks into a padded copy before attending, which on a
CPU costs more than the attention itself. This kernel reads each block where it lies in the paged
cache, once, with one OpenMP task per (sequence, KV head) and the query heads of that group together.
`paged_decode_attention_reference` (in kernels/decode_attention.py) is what it is tested against.

Built with torch.utils.cpp_extension.load_inline (needs a C++ compiler and ninja) into our own cache
folder, once (`make install` does it ahead); later processes import the built library directly, without
torch's build lock, which a process killed mid-build would otherwise leave behind for every later one
to wait on forever. `load()` returns None when it cannot be built; callers fall back to the torch path.
"""

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// q [B, Hq, D], k_cache/v_cache [num_blocks, block_size, Hkv, D], block_tables [B, M] int32,
// context_lens [B] int32 -> out [B, Hq, D]. All float32 and contiguous.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  auto out = torch::zeros_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; ++b) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t len = lens[b];
        if (len <= 0) continue;
        scores.assign(group * len, 0.0f);
        const float* q_group = q_ptr + (b * num_heads + h * group) * head_dim;
        const int32_t* table = tables + b * max_blocks;
        for (int64_t t = 0; t < len; ++t) {
          const float* key = k_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride
                             + h * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float* query = q_group + g * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
            scores[g * len + t] = dot * fscale;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* row = scores.data() + g * len;
          const float row_max = *std::max_element(row, row + len);
          float total = 0.0f;
          for (int64_t t = 0; t < len; ++t) { row[t] = std::exp(row[t] - row_max); total += row[t]; }
          const float inv = 1.0f / total;
          for (int64_t t = 0; t < len; ++t) row[t] *= inv;
        }
        float* out_group = out_ptr + (b * num_heads + h * group) * head_dim;
        for (int64_t t = 0; t < len; ++t) {
          const float* value = v_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride
                               + h * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t];
            float* acc = out_group + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * value[d];
          }
        }
      }
    }
  }
  return out;
}
"""

_lock = threading.Lock()
_module = None
_failed = False


def _cpu_tag() -> str:
    """Builds use -march=native, so the build is keyed to this CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags + _SOURCE).encode()).hexdigest()[:10]


STALE_BUILD_LOCK_S = 600.0  # a build takes well under a minute; an older lock is a killed builder's


def build_directory(name: str) -> Path:
    cache = os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve")
    return Path(cache) / "kernels" / name


def load():
    """The compiled extension, or None if it cannot be built here (logged once)."""
    global _module, _failed
    with _lock:
        if _module is None and not _failed and os.environ.get("LLMSERVE_DISABLE_CPU_KERNELS") != "1":
            name = f"llmserve_cpu_attention_{_cpu_tag()}"
            directory = build_directory(name)
            try:
                _module = _import_built(name, directory) or _build(name, directory)
            except Exception as exc:  # a missing compiler or ninja: the torch path still works
                _failed = True
                logger.warning("CPU attention kernel unavailable, using the torch path: %s", exc)
        return _module


def _import_built(name: str, directory: Path):
    """The library a previous build left in `directory`, or None if there is none that imports."""
    library = directory / f"{name}.so"
    if not library.is_file():
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(library))
        spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except ImportError as exc:  # a build cut short: build again
        logger.warning("rebuilding the CPU attention kernel: %s", exc)
        return None


def _build(name: str, directory: Path):
    from torch.utils.cpp_extension import load_inline

    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
        logger.warning("removing a stale kernel build lock left by a killed build: %s", lock)
        lock.unlink(missing_ok=True)
    return load_inline(name=name, cpp_sources=[_SOURCE], functions=["paged_decode"], build_directory=str(directory),
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] over each row's first context_lens tokens of the paged cache -> [B, Hq, D] (fp32, CPU)."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU attention kernel could not be built")
    return module.paged_decode(q.contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                               context_lens.to(torch.int32).contiguous(), float(scale))
