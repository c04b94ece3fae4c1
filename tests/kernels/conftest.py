"""Kernel tests run on CPU under the Triton interpreter, or on CUDA when TRITON_INTERPRET=0 is set.

triton 3.9 reads TRITON_INTERPRET (knobs.runtime.interpret) whenever `@triton.jit` decorates a function:
for our kernels when their modules are imported, and for triton.language's own jit helpers (tl.zeros,
tl.sum, tl.max, ...) when triton.language is first imported. So the variable must be set before triton
is imported at all. It is set here at import time, which suffices when this directory runs alone or is
collected before anything imports triton; if an earlier test module imported triton (transformers does),
every kernel test fails with a message saying so, rather than running half-compiled.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from services.engine.kernels.paged_tile import interpreting  # noqa: E402

INTERPRET = interpreting()
KERNEL_MODULES = ("store_kv", "decode_attention", "prefill_attention")


def _not_interpreted() -> list[str]:
    """Names of jit functions that were built for a GPU although the interpreter is on."""
    import importlib

    found = [] if isinstance(tl.standard.zeros, InterpretedFunction) else ["triton.language (imported too early)"]
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"services.engine.kernels.{name}")
        found += [f"{name}.{attr}" for attr, value in vars(module).items()
                  if isinstance(value, triton.runtime.JITFunction)]
    return found


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cpu under the interpreter; cuda when the interpreter is off (e.g. the GPU check script)."""
    if INTERPRET:
        stale = _not_interpreted()
        if stale:
            pytest.fail("TRITON_INTERPRET=1 was set after triton was imported, so these are compiled for a GPU: "
                        f"{', '.join(stale)}. Set it in the environment or in tests/conftest.py.")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device")
    return torch.device("cuda")
