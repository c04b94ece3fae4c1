"""Tensor-parallel worker processes (ranks 1..N-1): started and stopped here, run by an entry function the
caller passes in (the model runner's), so this package never imports the runner.

Each worker builds its own shard of the model and its KV cache, then runs every step rank 0 broadcasts
until a broadcast None ends its loop. Only rank 0 samples.
"""

import logging
import multiprocessing.process
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0

WorkerEntry = Callable[[Any, int], None]  # entry(args, rank), run in the worker process; module-level (pickled)


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 at the time of asking (for tests of an explicit distributed_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_workers(entry: WorkerEntry, args: Any, world_size: int) -> list[multiprocessing.process.BaseProcess]:
    """Start ranks 1..world_size-1 with torch.multiprocessing (spawn), each running entry(args, rank)."""
    context = mp.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        process = context.Process(target=entry, args=(args, rank), name=f"llmserve-tp-rank{rank}", daemon=True)
        process.start()
        workers.append(process)
    return workers


def stop_workers(workers: list[multiprocessing.process.BaseProcess], timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Wait for workers to exit (they leave their loop on the broadcast None); terminate stragglers."""
    for process in workers:
        process.join(timeout_s)
        if process.is_alive():
            logger.warning("tensor-parallel worker %s did not exit; terminating it", process.name)
            process.terminate()
            process.join(timeout_s)
