"""Where tensor-parallel groups meet: by default on a free port chosen at launch (held from then on), so two
engines can start on one host at once; an explicit distributed_port is still honoured."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.engine import LLM, SamplingParams
from services.engine.config import EngineArgs
from services.engine.distributed import parallel_state
from services.engine.distributed.worker import free_port
from tests.models.test_tiny_checkpoints import CASES, build_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(num_kvcache_blocks=64, kvcache_block_size=16, device="cpu", enable_prefix_caching=False)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46]]
MAX_TOKENS = 8
# A second engine in its own process (one tensor-parallel group per process), default port, greedy ids out.
SECOND_ENGINE = textwrap.dedent("""
    import json, sys
    from services.engine import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
    greedy = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]), ignore_eos=True)
    outputs = llm.generate(json.loads(sys.argv[3]), greedy, use_tqdm=False)
    print(json.dumps([o["token_ids"] for o in outputs]))
    llm.shutdown()
""")


def _is_bound(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_default_port_is_chosen_at_launch():
    assert EngineArgs().distributed_port == 0


def test_each_rendezvous_holds_its_own_free_port():
    first, second = parallel_state.open_rendezvous(), parallel_state.open_rendezvous()
    assert 0 < first.port != second.port > 0
    assert _is_bound(first.port) and _is_bound(second.port), "the port is held, not merely probed"


def test_an_explicit_port_is_the_one_opened():
    port = free_port()
    store = parallel_state.open_rendezvous(port)
    assert store.port == port and _is_bound(port)


def test_two_tensor_parallel_engines_start_on_one_host_at_once(tmp_path):
    kind, overrides = CASES["llama"]
    build_checkpoint(kind, overrides, tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)  # default port, this process is rank 0
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "clients" / "python")])}
        second = subprocess.run([sys.executable, "-c", SECOND_ENGINE, str(tmp_path), json.dumps(ENGINE),
                                 json.dumps(PROMPTS), str(MAX_TOKENS)],
                                capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
        assert second.returncode == 0, second.stderr[-3000:]
        expected = [o["token_ids"] for o in first.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        first.shutdown()
    assert json.loads(second.stdout.strip().splitlines()[-1]) == expected
    assert all(len(ids) == MAX_TOKENS for ids in expected)
