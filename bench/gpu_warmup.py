"""The GPU check's warm-up: build what its timed test step would otherwise build cold.

    python bench/gpu_warmup.py tests/kernels tests/gpu_path/test_cuda_only.py

Runs each given test file (a directory: its test_*.py files) in its own pytest process, all at once, so the
~60 Triton compiles happen in parallel and land in Triton's on-disk cache, and meanwhile builds the C++ CPU
decode kernel (torch's extension cache keeps it). Test outcomes here are informational: the timed step that
follows is the one that judges. Exits 0 unless a path does not exist.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def build_cpu_kernel() -> str:
    from services.engine.kernels import cpu_decode_attention

    started = time.perf_counter()
    built = cpu_decode_attention.load() is not None
    return f"C++ CPU decode kernel {'built' if built else 'unavailable'} in {time.perf_counter() - started:.1f}s"


def test_files(paths: list[str]) -> list[Path]:
    files = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise SystemExit(f"no such test path: {name}")
        files += sorted(path.glob("test_*.py")) if path.is_dir() else [path]
    return files


def last_line(text: str) -> str:
    lines = [line.strip("= ") for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def start_all(files: list[Path]) -> list[tuple[Path, object, subprocess.Popen]]:
    """One pytest per file, all started at once."""
    runs = []
    for path in files:
        log = tempfile.TemporaryFile("w+")  # not a pipe: a long failure report must not stall its process
        command = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider"]
        runs.append((path, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)))
    return runs


def finish_all(runs, started: float) -> list[str]:
    """Wait for every run: a line per file, then the wall time since `started`."""
    lines = []
    for path, log, proc in runs:
        proc.wait()
        log.seek(0)
        lines.append(f"{path}: {last_line(log.read())} (exit {proc.returncode})")
        log.close()
    lines.append(f"{len(runs)} test files in parallel: {time.perf_counter() - started:.1f}s")
    return lines


def run_in_parallel(files: list[Path]) -> list[str]:
    return finish_all(start_all(files), time.perf_counter())


def main(argv: list[str] | None = None) -> None:
    files = test_files(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("PYTHONPATH", str(REPO_ROOT))
    started = time.perf_counter()
    runs = start_all(files)
    # Built here meanwhile; a test file that needs it waits on torch's build lock and then loads it.
    print(build_cpu_kernel(), flush=True)
    print("\n".join(finish_all(runs, started)), flush=True)


if __name__ == "__main__":
    main()
