"""Model files are leaves: they import layers/ and models/ only, never the runner or the engine core."""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
import services.engine.models.registry
print(json.dumps(sorted(m for m in sys.modules if m.startswith("services.engine."))))
"""


def test_models_import_no_runner_core_or_loader():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, check=True)
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "services.engine.models.llama" in loaded and "services.engine.models.qwen3" in loaded
    for forbidden in ("services.engine.runner", "services.engine.core", "services.engine.loader"):
        assert not any(m == forbidden or m.startswith(forbidden + ".") for m in loaded), loaded
