"""Run buf's checks on the gRPC contracts in protos/: lint, format, and breaking-change detection.

Breaking changes are checked against two references:
- protos/baseline/v1.json, a committed buf image of the released v1 contracts. It needs no git history, so the
  check works the same in a fresh clone, in CI and before the first commit, and it also catches a breaking change
  that has already been committed.
- the last commit (`.git#ref=HEAD`), which catches breaking an uncommitted change to fields added since the
  baseline was taken. Skipped when HEAD has no protos/ yet or this is not a git checkout.

    python tools/buf_check.py                    # all checks; exit 1 if any fails, 2 if buf is missing
    python tools/buf_check.py --update-baseline  # after a reviewed, additive release: re-take the baseline

buf itself comes pinned from tools/package.json (`npm ci --prefix tools`); a buf on PATH is used otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODULE_DIR = "protos"
BASELINE = REPO_ROOT / MODULE_DIR / "baseline" / "v1.json"
LOCAL_BUF = REPO_ROOT / "tools" / "node_modules" / ".bin" / "buf"


@dataclass(slots=True)
class CheckResult:
    """The outcome of one buf invocation."""

    name: str
    ok: bool
    output: str


def find_buf() -> str | None:
    """The pinned buf from tools/node_modules, else one on PATH, else None."""
    if LOCAL_BUF.exists():
        return str(LOCAL_BUF)
    return shutil.which("buf")


def run_buf(buf: str, name: str, args: list[str], root: Path = REPO_ROOT) -> CheckResult:
    """Run `buf ARGS` in root (the directory holding buf.yaml) and capture its output."""
    proc = subprocess.run([buf, *args], cwd=root, capture_output=True, text=True, timeout=300)
    return CheckResult(name, proc.returncode == 0, (proc.stdout + proc.stderr).strip())


def lint(buf: str, root: Path = REPO_ROOT) -> CheckResult:
    """buf lint with the rules in buf.yaml (STANDARD + COMMENTS)."""
    return run_buf(buf, "lint", ["lint", MODULE_DIR], root)


def format_check(buf: str, root: Path = REPO_ROOT) -> CheckResult:
    """Fails (showing the diff) when a proto is not in buf's canonical format; `buf format -w` fixes it."""
    return run_buf(buf, "format", ["format", MODULE_DIR, "--diff", "--exit-code"], root)


def breaking_vs_baseline(buf: str, root: Path = REPO_ROOT, baseline: Path = BASELINE) -> CheckResult:
    """buf breaking (FILE rules) against the committed v1 baseline image."""
    return run_buf(buf, "breaking vs baseline", ["breaking", MODULE_DIR, "--against", str(baseline)], root)


def head_has_protos(root: Path = REPO_ROOT) -> bool:
    """Whether root is a git checkout whose HEAD commit contains protos/ and buf.yaml."""
    for path in (MODULE_DIR, "buf.yaml"):
        try:
            proc = subprocess.run(["git", "cat-file", "-e", f"HEAD:{path}"], cwd=root, capture_output=True)
        except OSError:  # no git at all
            return False
        if proc.returncode != 0:
            return False
    return True


def breaking_vs_head(buf: str, root: Path = REPO_ROOT) -> CheckResult:
    """buf breaking (FILE rules) of the working tree against the last commit."""
    against = f".git#ref=HEAD,subdir={MODULE_DIR}"
    return run_buf(buf, "breaking vs HEAD", ["breaking", MODULE_DIR, "--against", against], root)


def update_baseline(buf: str, root: Path = REPO_ROOT, baseline: Path = BASELINE) -> None:
    """Write the current contracts as the baseline image (indented JSON, so reviews can diff it)."""
    baseline.parent.mkdir(parents=True, exist_ok=True)
    raw = baseline.with_suffix(".tmp.json")
    try:
        result = run_buf(buf, "build", ["build", MODULE_DIR, "--exclude-source-info", "-o", str(raw)], root)
        if not result.ok:
            raise RuntimeError(result.output)
        image = json.loads(raw.read_text())
    finally:
        raw.unlink(missing_ok=True)
    baseline.write_text(json.dumps(image, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-baseline", action="store_true", help="re-take protos/baseline/v1.json")
    args = parser.parse_args(argv)
    buf = find_buf()
    if buf is None:
        print("buf is not installed: run `npm ci --prefix tools` (make install does)", file=sys.stderr)
        return 2
    if args.update_baseline:
        update_baseline(buf)
        print(f"wrote {BASELINE.relative_to(REPO_ROOT)}")
        return 0
    results = [lint(buf), format_check(buf), breaking_vs_baseline(buf)]
    if head_has_protos():
        results.append(breaking_vs_head(buf))
    else:
        print("buf breaking vs HEAD: skipped (HEAD has no protos/ yet)")
    for result in results:
        print(f"buf {result.name}: {'ok' if result.ok else 'FAILED'}")
        if not result.ok:
            print(result.output)
    return 0 if all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
