"""`llmserve-tokenizer` (`python -m services.tokenizer`): the public API in front of engine replicas.

`--engine` names one or more engine targets (repeated and/or comma-separated); a DNS name stands for every
address it resolves to (a Kubernetes headless Service, a compose service scaled to N), resolved again as replicas
come and go. `--routing` picks a replica per request (services/tokenizer/routing.py has the rule).

With `--workers N`, N processes share the port (services.common.reuseport); each is a full relay with its
own tokenizer, engine channel and health. This process is the first of them and prints the listening line.
"""

import argparse
import asyncio
import functools
import logging
import os

from services.common.gc_heap import freeze_startup_heap
from services.common.grpc_server import ServingState, build_server, configure_logging, run_until_signalled
from services.common.metrics import MetricsEndpoint, add_observability_args, check_observability_args
from services.common.reuseport import WorkerGroup, exit_after_drain, reserve_port
from services.tokenizer.routing import Routing
from services.tokenizer.routing_targets import parse_targets

logger = logging.getLogger("llmserve.tokenizer")
MAX_DEFAULT_WORKERS = 4


def default_workers() -> int:
    """A quarter of the usable cores, 1 to 4. The engine's core process and its API fronts need cores too."""
    return max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0)) // 4))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve-tokenizer",
                                     description="llmserve tokenizer service (public TextGenerationService)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0 = any free port)")
    parser.add_argument("--engine", action="append", metavar="HOST:PORT[,HOST:PORT...]",
                        help="engine replica targets, repeated or comma-separated; a DNS name means every address "
                             "it resolves to, re-resolved every few seconds (default: 127.0.0.1:50052)")
    parser.add_argument("--routing", type=Routing, choices=list(Routing), default=Routing.PREFIX,
                        help="how a request picks a replica: prefix (longest cached prompt prefix unless that "
                             "replica is too busy), least-load, round-robin (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="tokenizer source: HF checkpoint directory or .gguf file (default: the embedded model)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="processes serving the port; each relays ~4-5k tokens/s per core (bench/stack.py) "
                             f"(default: a quarter of the cores, 1 to {MAX_DEFAULT_WORKERS}; here {default_workers()})")
    parser.add_argument("--engine-calls", choices=["batched", "per-request"], default="batched",
                        help="batched: each worker's requests to a replica share one GenerateBatch stream (one "
                             "message per engine step); per-request: a Generate call each (default: %(default)s)")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens when a request leaves it unset (capped by max_model_len)")
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("LLMSERVE_LOG_LEVEL", "INFO"))
    add_observability_args(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    check_observability_args(parser, args)
    args.engine = ",".join(args.engine or ["127.0.0.1:50052"])  # one string, as a single --engine reads
    try:
        args.engine_targets = parse_targets([args.engine])
    except ValueError as exc:
        parser.error(f"--engine: {exc}")
    if args.model == "":
        args.model = None
    return args


async def serve(args: argparse.Namespace, port: int, workers: WorkerGroup | None = None,
                endpoint: MetricsEndpoint | None = None) -> None:
    """One relay process on `port`; the first one (the caller of main) also supervises `workers` and serves
    the metrics `endpoint`."""
    from services.tokenizer.serving.engine_client import EngineClient
    from services.tokenizer.serving.engine_pool import EnginePool
    from services.tokenizer.limits import InputLimits
    from services.tokenizer.serving.server import SERVICE_NAME, TextGenerationServicer, health_follower
    from services.tokenizer.tokenizer import TextTokenizer

    tokenizer = await asyncio.to_thread(TextTokenizer.load, args.model)
    state = ServingState(SERVICE_NAME)
    connect = functools.partial(EngineClient, batched=args.engine_calls == "batched")
    engines = EnginePool(args.engine_targets, tokenizer.fingerprint(), args.routing, health_follower(state), connect)
    limits = await asyncio.to_thread(InputLimits.of, tokenizer)
    servicer = TextGenerationServicer(tokenizer, engines, state, args.default_max_tokens, limits, _metrics(args))
    # NOTE: before the port is added, which starts listening: with --workers the kernel hands this process
    # connections from then on, and the freeze takes a few hundred ms.
    freeze_startup_heap()
    server = build_server([SERVICE_NAME], state, servicer.register, reuse_port=args.workers > 1,
                          max_receive_bytes=limits.receive_bytes(tokenizer.context_length()))
    port = server.add_insecure_port(f"{args.host}:{port}")
    await server.start()
    await state.mark_alive()
    is_first = workers is not None
    if is_first:
        print(f"llmserve-tokenizer listening on {args.host}:{port} (engine {args.engine}, "
              f"routing {args.routing.value}, {args.workers} worker{'s' if args.workers > 1 else ''})", flush=True)
    if endpoint is not None:
        metrics_port = endpoint.start(args.host, args.metrics_port)
        print(f"llmserve-tokenizer metrics on http://{args.host}:{metrics_port}/metrics", flush=True)
    await engines.start()

    async def stop_watch() -> None:
        await engines.close()

    await run_until_signalled(server, state, args.grace_period, stop_watch, workers, handle_sigint=is_first)


def _metrics(args: argparse.Namespace):
    """This worker's TokenizerMetrics when --metrics-port is set (in the directory the parent prepared)."""
    if not args.metrics_port:
        return None
    from services.tokenizer.serving import metrics

    return metrics.enable()


def serve_worker(args: argparse.Namespace, port: int) -> None:
    """Entry of the extra worker processes (spawned: a fresh interpreter each)."""
    configure_logging(args.log_level, args.log_format)
    try:
        asyncio.run(serve(args, port))
    finally:
        if args.metrics_port:  # its in-flight gauge leaves the sum; its counts stay
            MetricsEndpoint.mark_dead([os.getpid()])
    exit_after_drain(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    # NOTE: before the workers start: they inherit the metrics directory.
    endpoint = MetricsEndpoint.prepare() if args.metrics_port else None
    try:
        if args.workers == 1:  # no port sharing: a second server on the same port fails to bind, as it should
            workers = WorkerGroup(serve_worker, args, args.port, 0)
            asyncio.run(serve(args, args.port, workers, endpoint))
        else:
            with reserve_port(args.host, args.port) as port, \
                    WorkerGroup(serve_worker, args, port, args.workers - 1, "tokenizer-worker") as workers:
                asyncio.run(serve(args, port, workers, endpoint))
    finally:
        if endpoint is not None:
            endpoint.close()
    exit_after_drain(workers.exit_code)


if __name__ == "__main__":
    main()
