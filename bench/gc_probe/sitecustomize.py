"""Records every garbage collection of a Python process started with this folder on PYTHONPATH and
LLMSERVE_GC_PROBE_DIR set (bench/tokenizer_relay.py --gc-pauses): each collection's start (time.monotonic, which
every process on the host shares), generation and duration, rewritten to DIR/<pid>.json every second."""

import os

_DIRECTORY = os.environ.get("LLMSERVE_GC_PROBE_DIR")

if _DIRECTORY:
    import gc
    import json
    import multiprocessing
    import sys
    import threading
    import time

    _collections: list[tuple[float, int, float]] = []  # (start, generation, seconds)
    _started = [0.0]

    def _on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            _started[0] = time.monotonic()
        else:
            _collections.append((_started[0], info["generation"], time.monotonic() - _started[0]))

    def _dump_every_second() -> None:
        path = os.path.join(_DIRECTORY, f"{os.getpid()}.json")
        while True:
            time.sleep(1.0)
            record = {"process": multiprocessing.current_process().name, "argv": sys.argv[:1],
                      "collections": list(_collections)}
            with open(path + ".tmp", "w") as file:
                json.dump(record, file)
            os.replace(path + ".tmp", path)

    gc.callbacks.append(_on_collection)
    threading.Thread(target=_dump_every_second, name="gc-probe", daemon=True).start()
