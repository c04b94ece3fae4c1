"""bench/kernels_gpu.py stays runnable: --help, and its CPU dry run under the interpreter."""

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "bench.kernels_gpu", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=300)


def test_help():
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    assert "--block-sizes" in result.stdout


def test_smoke_run_checks_every_kernel_and_prints_the_table():
    result = _run("--smoke")
    assert result.returncode == 0, result.stderr
    checks = [line for line in result.stdout.splitlines() if line.startswith("check ")]
    assert len(checks) == 6 and all(line.endswith(" ok") for line in checks), result.stdout
    table = result.stdout.split("theirs/ours")[1].strip().splitlines()
    assert [line.split()[0] for line in table] == ["store_kv"] * 2 + ["decode"] * 2 + ["prefill"] * 2
