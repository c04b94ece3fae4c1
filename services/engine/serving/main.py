"""`python -m services.engine` / `llmserve-engine`: start the engine-core process and the gRPC fronts.

Processes: this one (front 0, and the supervisor), the engine-core process (model, scheduler, step loop),
and `--api-workers - 1` more fronts (services.common.reuseport). Every front serves the same port (the
kernel spreads connections over them) and relays its own streams over its own connection to the core.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal

from services.common.gc_heap import freeze_startup_heap
from services.common.grpc_server import ServingState, build_server, configure_logging, run_until_signalled
from services.common.metrics import MetricsEndpoint, add_observability_args, check_observability_args
from services.common.reuseport import WorkerGroup, exit_after_drain, reserve_port
from services.engine.serving.cli_args import add_engine_args, engine_args_from

logger = logging.getLogger("llmserve.engine")
CORE_START_TIMEOUT_S = 1800.0
CORE_EXIT_TIMEOUT_S = 10.0
MESSAGE_OVERHEAD_BYTES = 64 * 1024  # a GenerateRequest beyond its prompt ids: id, sampling, stop ids


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
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="send a stream's tokens every N tokens (the first and the last at once): fewer, larger "
                             "messages on both hops, at the cost of burstier inter-token times")
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("LLMSERVE_LOG_LEVEL", "INFO"))
    add_observability_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.api_workers < 0:
        parser.error("--api-workers must be >= 0")
    if args.stream_interval < 1:
        parser.error("--stream-interval must be >= 1")
    check_observability_args(parser, args)
    args.api_workers = args.api_workers or default_api_workers()
    return args


class Front:
    """One gRPC front: a server on the shared port relaying to the engine-core process over `connection`."""

    def __init__(self, args: argparse.Namespace, connection, metrics_endpoint: MetricsEndpoint | None = None):
        self.args = args
        self.connection = connection
        self.metrics_endpoint = metrics_endpoint  # the first front's: it serves /metrics
        self.exit_code = 0

    async def serve(self, port: int, workers: WorkerGroup | None = None, on_ready=None) -> None:
        """Serve until signalled. The first front (with `workers`) warms the engine up and supervises."""
        from services.engine.serving.async_engine import AsyncEngine
        from services.engine.core.request_validator import RequestValidator
        from services.engine.serving.server import SERVICE_NAME, EngineServicer, engine_info

        engine = await asyncio.to_thread(AsyncEngine.connect, self.connection, self._core_lost, CORE_START_TIMEOUT_S,
                                         self.args.stream_interval)
        engine.start()
        description = engine.description
        state = ServingState(SERVICE_NAME)
        validator = RequestValidator.for_config(description.scheduler_config, description.vocab_size)
        servicer = EngineServicer(engine, engine_info(description), state, validator, self._metrics())
        max_receive_bytes = 5 * description.scheduler_config.max_model_len + MESSAGE_OVERHEAD_BYTES
        freeze_startup_heap()  # before the port is added, which starts listening
        server = build_server([SERVICE_NAME], state, servicer.register, reuse_port=self.args.api_workers > 1,
                              max_receive_bytes=max_receive_bytes)
        port = server.add_insecure_port(f"{self.args.host}:{port}")
        await server.start()
        await state.mark_alive()
        is_first = workers is not None
        if is_first:
            await servicer.warm_up()
        await state.mark_ready()
        if self.metrics_endpoint is not None:
            self._serve_metrics(engine)
        if on_ready is not None:
            on_ready(servicer, port)

        async def stop_relay() -> None:
            engine.shutdown()

        await run_until_signalled(server, state, self.args.grace_period, stop_relay, workers, handle_sigint=is_first)

    def _metrics(self):
        """This front's EngineMetrics when --metrics-port is set (in the directory the parent prepared)."""
        if not self.args.metrics_port:
            return None
        from services.engine.serving.metrics import EngineMetrics

        return EngineMetrics()

    def _serve_metrics(self, engine) -> None:
        from services.engine.serving.metrics import EngineStatsCollector

        port = self.metrics_endpoint.start(self.args.host, self.args.metrics_port, [EngineStatsCollector(engine.stats)])
        print(f"llmserve-engine metrics on http://{self.args.host}:{port}/metrics", flush=True)

    def _core_lost(self) -> None:
        """The core died: streams already failed UNAVAILABLE; drain (health NOT_SERVING) and exit non-zero."""
        self.exit_code = 1
        os.kill(os.getpid(), signal.SIGTERM)


def run_api_worker(args: argparse.Namespace, port: int, connection) -> None:
    """Entry point of fronts 1..N-1 (spawned by WorkerGroup, each with its own connection to the core)."""
    configure_logging(args.log_level, args.log_format)
    front = Front(args, connection)
    asyncio.run(front.serve(port))
    exit_after_drain(front.exit_code)


def run(args: argparse.Namespace) -> int:
    """Run the service until signalled; the exit code is non-zero if a process of the service died."""
    # NOTE: before any other process starts: they all inherit the metrics directory.
    endpoint = MetricsEndpoint.prepare() if args.metrics_port else None
    try:
        return _run(args, endpoint)
    finally:
        if endpoint is not None:
            endpoint.close()


def _run(args: argparse.Namespace, endpoint: MetricsEndpoint | None) -> int:
    from services.engine.serving.engine_process import start_engine_core

    engine_args = engine_args_from(args)
    engine_args.model = engine_args.model or None  # "" (compose's unset LLMSERVE_MODEL): the embedded default
    # NOTE: started from the main thread: the core asks for SIGKILL when its parent *thread* exits.
    core, connections = start_engine_core(args.api_workers, {name: getattr(engine_args, name)
                                                             for name in engine_args.field_names()},
                                            args.log_level, args.log_format)
    logger.info("engine core process: pid %d", core.pid)
    front = Front(args, connections[0], endpoint)
    # One front binds the port alone (a second server on it fails, as it should); several share it.
    sharing = reserve_port(args.host, args.port) if args.api_workers > 1 else contextlib.nullcontext(args.port)
    with sharing as port:
        workers = WorkerGroup(run_api_worker, args, port, args.api_workers - 1, "llmserve-engine-api",
                              extra_args=[(connection,) for connection in connections[1:]])

        def on_ready(servicer, port: int) -> None:
            workers.start()
            for connection in connections[1:]:
                connection.close()
            info = servicer.info
            print(f"llmserve-engine listening on {args.host}:{port}", flush=True)
            logger.info("ready: %s on %s (%s), %d KV blocks, %d API workers", info.model_name, info.device,
                        info.dtype, info.num_total_blocks, args.api_workers)

        try:
            asyncio.run(front.serve(port, workers, on_ready))
        finally:
            workers.stop()
            workers.join()
            core.join(CORE_EXIT_TIMEOUT_S)  # it leaves once every front has hung up
            if core.is_alive():
                logger.warning("the engine core did not exit; killing it")
                core.kill()
    return front.exit_code or workers.exit_code


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    exit_after_drain(run(args))


if __name__ == "__main__":
    main()
