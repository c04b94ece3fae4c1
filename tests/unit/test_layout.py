"""Import rules: services.engine.core pulls in no torch, numpy, grpc, protobuf or triton."""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "numpy", "grpc", "google.protobuf", "triton")
EXPECTED_MODULES = {"block_manager", "config", "engine", "errors", "interfaces", "sampling_params", "scheduler", "sequence"}

# Imports the core package and every module in it, then reports which forbidden modules got loaded.
PROBE = """
import importlib, json, pkgutil, sys
{extra}
import services.engine.core as core
names = [info.name for info in pkgutil.walk_packages(core.__path__, core.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps({{
    "modules": names,
    "forbidden": [m for m in {forbidden!r} if m in sys.modules],
}}))
"""


def probe_core_imports(extra: str = "") -> dict:
    code = PROBE.format(extra=extra, forbidden=FORBIDDEN)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_core_imports_no_heavy_or_rpc_modules():
    report = probe_core_imports()
    assert EXPECTED_MODULES <= {name.rsplit(".", 1)[-1] for name in report["modules"]}
    assert report["forbidden"] == []


def test_probe_detects_a_forbidden_import():
    assert probe_core_imports("import numpy")["forbidden"] == ["numpy"]
