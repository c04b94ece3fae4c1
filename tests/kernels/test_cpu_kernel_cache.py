"""The built CPU kernel is imported directly: a build lock left by a killed process never blocks a later load."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.kernels import cpu_decode_attention

pytestmark = pytest.mark.skipif(cpu_decode_attention.load() is None, reason="no C++ toolchain to build the kernel")
LOAD_TIMEOUT_S = 120


def test_a_left_over_build_lock_does_not_block_loading_the_built_kernel(tmp_path):
    name = f"llmserve_cpu_attention_{cpu_decode_attention._cpu_tag()}"
    built = Path(cpu_decode_attention._module.__file__)
    copy = tmp_path / "kernels" / name
    copy.mkdir(parents=True)
    shutil.copy(built, copy / built.name)
    (copy / "lock").touch()  # what torch's FileBaton leaves when its holder is killed mid-build
    code = ("from services.engine.kernels import cpu_decode_attention as k; m = k.load(); "
            "print(m.__file__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LOAD_TIMEOUT_S,
                            env={"LLMSERVE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
                                 "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(copy / built.name)
