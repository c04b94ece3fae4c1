"""`python -m services.engine` / `llmserve-engine`: start the engine-core process and the gRPC fronts.

Processes: this one (front 0, and the supervisor), the engine-core process (model, scheduler, step loop),
and `--api-workers - 1` more fronts. Every front serves the same port (SO_REUSEPORT: the kernel spreads
connections over them) and relays its own streams over its own connection to the core.
"""

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading

from services.common.grpc_server import ServingState, build_server, configure_logging, run_until_signalled
from services.engine.serving.cli_args import add_engine_args, engine_args_from

logger = logging.getLogger("llmserve.engine")
CORE_START_TIMEOUT_S = 1800.0
JOIN_TIMEOUT_S = 10.0


def default_api_workers(num_cpus: int | None = None) -> int:
    """One front per two spare cores, at most 4: the core process keeps one core busy on its own."""
    num_cpus = num_cpus or os.cpu_count() or 1
    return max(1, min(4, (num_cpus - 1) // 2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve-engine", description="llmserve engine service (token ids in, token ids out)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument("--port", type=int, default=50052, help="port to listen on (0 = any free port)")
    parser.add_argument("--api-workers", type=int, default=0,
                        help="gRPC front processes sharing the port (0 = one per two spare cores, at most 4; "
                             "each relays its streams to the one engine-core process)")
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("LLMSERVE_LOG_LEVEL", "INFO"))
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.api_workers < 0:
        parser.error("--api-workers must be >= 0")
    args.api_workers = args.api_workers or default_api_workers()
    return args


class Front:
    """One gRPC front: a server on the shared port relaying to the engine-core process over `connection`."""

    def __init__(self, args: argparse.Namespace, connection):
        self.args = args
        self.connection = connection
        self.engine = None
        self.exit_code = 0
        self.workers: list[mp.process.BaseProcess] = []  # fronts to pass a stop signal on to
        self.stopping = False

    async def serve(self, port: int, on_ready=None) -> None:
        from services.engine.serving.async_engine import AsyncEngine
        from services.engine.serving.server import SERVICE_NAME, EngineServicer, RequestValidator, engine_info

        self.engine = await asyncio.to_thread(AsyncEngine.connect, self.connection, self._core_lost,
                                              CORE_START_TIMEOUT_S)
        self.engine.start()
        description = self.engine.description
        state = ServingState(SERVICE_NAME)
        servicer = EngineServicer(self.engine, engine_info(description), state, RequestValidator(description))
        server = build_server([SERVICE_NAME], state, servicer.register)
        server.add_insecure_port(f"{self.args.host}:{port}")
        await server.start()
        await state.mark_alive()
        if on_ready is not None:
            await servicer.warm_up()
        await state.mark_ready()
        if on_ready is not None:
            await on_ready(servicer)

        async def stop_relay() -> None:
            self.engine.shutdown()

        # NOTE: a stop signal that came while this front was starting (see run_api_worker) is raised again
        # once run_until_signalled has installed its handlers, which happens before this callback runs.
        asyncio.get_running_loop().call_soon(_resend_early_stop)
        await run_until_signalled(server, state, self.args.grace_period, stop_relay, self.signal_workers)

    def signal_workers(self) -> None:
        self.stopping = True
        for worker in self.workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)

    def _core_lost(self) -> None:
        """The core died: streams already failed UNAVAILABLE; drain (health NOT_SERVING) and exit non-zero."""
        self.exit_code = 1
        os.kill(os.getpid(), signal.SIGTERM)


_early_stop = threading.Event()
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _note_early_stop(signum, frame) -> None:
    _early_stop.set()


def _resend_early_stop() -> None:
    if _early_stop.is_set():
        os.kill(os.getpid(), signal.SIGTERM)


def run_api_worker(args: argparse.Namespace, port: int, connection) -> None:
    """Entry point of fronts 1..N-1 (spawned processes)."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _note_early_stop)  # until the front serves: then it drains on the signal
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    configure_logging(args.log_level)
    front = Front(args, connection)
    asyncio.run(front.serve(port))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # drained already: a late SIGTERM must not change the exit code
    sys.exit(front.exit_code)


async def serve(args: argparse.Namespace) -> int:
    """Run the service until signalled; the exit code: non-zero if a process of the service died."""
    from services.engine.serving.engine_process import start_engine_core

    engine_args = engine_args_from(args)
    engine_args.model = engine_args.model or None  # "" (compose's unset LLMSERVE_MODEL): the embedded default
    # NOTE: started from the main thread: the core asks for SIGKILL when its parent *thread* exits.
    core, connections = start_engine_core(args.api_workers, {name: getattr(engine_args, name)
                                                             for name in engine_args.field_names()}, args.log_level)
    logger.info("engine core process: pid %d", core.pid)
    context = mp.get_context("spawn")
    front = Front(args, connections[0])
    workers = front.workers
    with _reserve_port(args.host, args.port) as port:

        async def on_ready(servicer) -> None:
            for index, connection in enumerate(connections[1:], start=1):
                worker = context.Process(target=run_api_worker, args=(args, port, connection),
                                         name=f"llmserve-engine-api-{index}", daemon=True)
                # NOTE: the child starts with stop signals blocked (the mask survives exec) and unblocks them
                # once its handler is in place: a drain that starts meanwhile is then noted, not fatal.
                signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
                try:
                    worker.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
                connection.close()
                workers.append(worker)
            asyncio.get_running_loop().create_task(_watch_processes([core, *workers], front))
            info = servicer.info
            print(f"llmserve-engine listening on {args.host}:{port}", flush=True)
            logger.info("ready: %s on %s (%s), %d KV blocks, %d API workers", info.model_name, info.device,
                        info.dtype, info.num_total_blocks, args.api_workers)

        try:
            await front.serve(port, on_ready)
        finally:
            if not front.stopping:
                front.signal_workers()
            _join_processes([*workers, core])
    return front.exit_code or _worst_exit_code(workers)


async def _watch_processes(processes: list[mp.process.BaseProcess], front: Front) -> None:
    """If any process of the service dies, drain the rest and exit non-zero so a supervisor can act."""
    loop = asyncio.get_running_loop()
    died = loop.create_future()
    for process in processes:
        loop.add_reader(process.sentinel, lambda p=process: died.done() or died.set_result(p))
    process = await died
    for other in processes:
        loop.remove_reader(other.sentinel)
    if front.stopping:
        return  # the processes leave because we asked them to
    logger.error("%s (pid %d) exited with code %s; stopping the service", process.name, process.pid,
                 process.exitcode)
    front.exit_code = 1
    os.kill(os.getpid(), signal.SIGTERM)


def _join_processes(processes: list[mp.process.BaseProcess]) -> None:
    """Wait for the fronts to drain, then for the core, which leaves once every front has hung up."""
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        logger.info("%s exited with code %s", process.name, process.exitcode)
        if process.is_alive():
            logger.warning("%s did not exit; killing it", process.name)
            process.kill()
            process.join(JOIN_TIMEOUT_S)


@contextlib.contextmanager
def _reserve_port(host: str, port: int):
    """Hold HOST:PORT (port 0: a free one) with SO_REUSEPORT so every front can bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        yield sock.getsockname()[1]


def _worst_exit_code(workers: list[mp.process.BaseProcess]) -> int:
    return max([0, *(abs(worker.exitcode or 0) for worker in workers)])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    sys.exit(asyncio.run(serve(args)))


if __name__ == "__main__":
    main()
