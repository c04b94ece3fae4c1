"""llama.cpp (through llama-cpp-python) as an optional competitor on the same GGUF file.

llama-cpp-python is not a dependency: PyPI ships it as a source package that compiles llama.cpp. Install it
yourself to enable the comparison, e.g. into a folder of its own, then put that folder on PYTHONPATH:

    pip install --no-deps --target /tmp/llama_cpp_site llama-cpp-python==0.3.16 diskcache   # compiles llama.cpp

Every function here takes token ids (the GGUF's own vocabulary, which is the embedded model's) so both engines
see identical prompts; sampling is greedy and EOS is never checked, so each runs exactly the asked length.
"""

from __future__ import annotations

import time


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load(gguf_path: str, threads: int, context_len: int):
    """A llama.cpp model on `threads` CPU threads with a `context_len`-token context (one sequence)."""
    from llama_cpp import Llama

    return Llama(model_path=gguf_path, n_ctx=context_len, n_batch=512, n_threads=threads,
                 n_threads_batch=threads, verbose=False, seed=0)


def _generate(llm, prompt: list[int], new_tokens: int) -> None:
    """Prefill `prompt` and decode `new_tokens` greedily, with no prefix reused from an earlier call."""
    llm.reset()  # forget the previous sequence: llama-cpp-python would otherwise reuse a matching prefix
    produced = 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        produced += 1
        if produced == new_tokens:
            break


def decode_ms(llm, prompt: list[int], new_tokens: int) -> float:
    """Milliseconds per output token after the first (the prefill time, measured alone, subtracted)."""
    _generate(llm, prompt, 2)
    start = time.perf_counter()
    _generate(llm, prompt, 1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    _generate(llm, prompt, new_tokens)
    total = time.perf_counter() - start
    return (total - first) / (new_tokens - 1) * 1e3


def run_workload(llm, workload: list[tuple[list[int], int]]) -> tuple[float, int]:
    """(seconds, tokens) for every (prompt, output length) of the workload, one sequence after another: the
    Python binding serves one sequence per model (its server's parallel slots are not exposed here)."""
    start = time.perf_counter()
    for prompt, num_output in workload:
        _generate(llm, prompt, num_output)
    return time.perf_counter() - start, sum(n for _, n in workload)
