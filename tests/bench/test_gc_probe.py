"""bench/gc_probe records a process's garbage collections; bench/tokenizer_relay.py --gc-pauses sums a window."""

import json
import os
import subprocess
import sys

from bench import tokenizer_relay

COLLECT_AND_WAIT = "import gc, time; gc.collect(); time.sleep(3 * {period})"


def test_a_probed_process_records_its_full_collection(tmp_path):
    env = {**os.environ, "LLMSERVE_GC_PROBE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(tokenizer_relay.GC_PROBE), *sys.path])}
    process = subprocess.run([sys.executable, "-c", COLLECT_AND_WAIT.format(period=tokenizer_relay.GC_PROBE_PERIOD_S)],
                             env=env, timeout=60, check=True)
    assert process.returncode == 0
    [record_path] = tmp_path.glob("*.json")
    collections = json.loads(record_path.read_text())["collections"]
    assert any(generation == 2 for _, generation, _ in collections), collections


def test_a_process_without_the_variable_records_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tokenizer_relay.GC_PROBE), *sys.path])}
    env.pop("LLMSERVE_GC_PROBE_DIR", None)
    subprocess.run([sys.executable, "-c", COLLECT_AND_WAIT.format(period=0.5)], cwd=tmp_path, env=env, timeout=60,
                   check=True)
    assert list(tmp_path.iterdir()) == []


def test_only_collections_that_began_within_the_load_are_summed(tmp_path):
    collections = [(3.9, 2, 0.5), (4.0, 2, 0.2), (6.0, 0, 0.001), (7.0, 1, 0.002), (10.0, 2, 0.1), (10.1, 2, 0.4)]
    (tmp_path / "123.json").write_text(json.dumps({"process": "llmserve-engine-core", "argv": ["-c"],
                                                   "collections": collections}))
    report = tokenizer_relay.gc_pauses(tmp_path, 4.0, 10.0)
    assert report.splitlines()[1].strip() == \
        "123 llmserve-engine-core: 2 full, longest 200.0 ms, 300.0 ms in all; 2 young, 3.0 ms in all"
