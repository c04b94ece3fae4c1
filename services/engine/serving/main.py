"""`python -m services.engine` / `llmserve-engine`: load the model, start the engine thread, serve gRPC."""

import argparse
import asyncio
import logging
import os
import sys

from services.common.grpc_server import ServingState, build_server, configure_logging, run_until_signalled
from services.engine.serving.async_engine import AsyncEngine
from services.engine.serving.cli_args import add_engine_args, engine_args_from

logger = logging.getLogger("llmserve.engine")
SWITCH_INTERVAL_S = 0.0005


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve-engine", description="llmserve engine service (token ids in, token ids out)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument("--port", type=int, default=50052, help="port to listen on (0 = any free port)")
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("LLMSERVE_LOG_LEVEL", "INFO"))
    add_engine_args(parser)
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from services.engine.serving.engine_process import EngineProcess
    from services.engine.serving.server import SERVICE_NAME, EngineServicer, engine_info

    engine_args = engine_args_from(args)
    core = await asyncio.to_thread(EngineProcess, {name: getattr(engine_args, name)
                                                   for name in engine_args.field_names()})
    engine = AsyncEngine(core, max_waiting=engine_args.max_waiting)
    engine.start()
    state = ServingState(SERVICE_NAME)
    servicer = EngineServicer(engine, engine_info(core.description), state)
    server = build_server([SERVICE_NAME], state, servicer.register)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    await state.mark_alive()
    print(f"llmserve-engine listening on {args.host}:{port}", flush=True)
    await servicer.warm_up()
    await state.mark_ready()
    logger.info("ready: %s on %s (%s), %d KV blocks", servicer.info.model_name, servicer.info.device,
                servicer.info.dtype, servicer.info.num_total_blocks)

    async def stop_engine() -> None:
        engine.shutdown()
        core.close()

    await run_until_signalled(server, state, args.grace_period, stop_engine)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model == "":
        args.model = None
    configure_logging(args.log_level)
    # NOTE: the engine thread hands the GIL back and forth around every torch op; with the gRPC thread
    # busy, the default 5 ms switch interval turns each hand-back into a long wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
