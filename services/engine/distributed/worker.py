"""Tensor-parallel worker processes (ranks 1..N-1), spawned by rank 0's model runner.

Each worker builds its own ModelRunner (its shard of the model, its KV cache, its CUDA graphs), then
loops: receive the step rank 0 broadcasts, run the forward (taking part in every collective), repeat;
a broadcast None ends the loop. Only rank 0 samples.
"""

import logging
import multiprocessing.process
import socket

import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for tests that start several groups)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_workers(args, world_size: int) -> list[multiprocessing.process.BaseProcess]:
    """Start ranks 1..world_size-1 with torch.multiprocessing (spawn), each running run_worker."""
    context = mp.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        process = context.Process(target=run_worker, args=(args, rank), name=f"llmserve-tp-rank{rank}", daemon=True)
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


def run_worker(args, rank: int) -> None:
    """Entry point of a worker process."""
    from services.engine.distributed.parallel_state import destroy_tensor_parallel
    from services.engine.runner.model_runner import ModelRunner

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    try:
        runner = ModelRunner(args, rank=rank)
        runner.serve_as_worker()
    finally:
        destroy_tensor_parallel()
