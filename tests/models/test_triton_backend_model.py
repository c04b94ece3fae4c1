"""The runner's metadata against the Triton backend: a tiny model under the Triton interpreter (CPU) gives
the same greedy ids as transformers, plain and with chunked prefill over the paged cache.

Runs in a subprocess because TRITON_INTERPRET must be set before triton is first imported.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from services.engine import LLM, SamplingParams
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint, hf_greedy

kind, overrides = CASES["llama-3kv-heads-dim24"]
hf_model = build_checkpoint(kind, overrides, sys.argv[1])
prompts = [[(7 * i + n) % 500 + 3 for i in range(n)] for n in (5, 23, 40)]
references = [hf_greedy(hf_model, p) for p in prompts]
llm = LLM(sys.argv[1], num_kvcache_blocks=64, attention_backend="triton", device="cpu", dtype="float32")
assert llm.runner.attention_backend.name == "triton"
greedy = SamplingParams(temperature=0.0, max_tokens=32)
for engine in (llm, llm.with_scheduler(max_num_batched_tokens=13)):
    got = [o["token_ids"] for o in engine.generate(prompts, greedy, use_tqdm=False)]
    assert got == references, (got, references)
print("OK")
"""


def test_tiny_model_on_the_interpreted_triton_backend(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
