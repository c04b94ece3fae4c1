"""`python -m services.tokenizer` / `llmserve-tokenizer`: the public API in front of an engine service."""

import argparse
import asyncio
import logging
import os

from services.common.grpc_server import ServingState, build_server, configure_logging, run_until_signalled

logger = logging.getLogger("llmserve.tokenizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve-tokenizer",
                                     description="llmserve tokenizer service (public TextGenerationService)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0 = any free port)")
    parser.add_argument("--engine", default="127.0.0.1:50052", help="engine service address HOST:PORT")
    parser.add_argument("--model", default=None,
                        help="tokenizer source: HF checkpoint directory or .gguf file (default: the embedded model)")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens when a request leaves it unset (capped by max_model_len)")
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("LLMSERVE_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from services.tokenizer.engine_client import EngineClient
    from services.tokenizer.server import SERVICE_NAME, TextGenerationServicer, keep_health_in_step
    from services.tokenizer.tokenizer import TextTokenizer

    tokenizer = await asyncio.to_thread(TextTokenizer.load, args.model)
    engine = EngineClient(args.engine, tokenizer.fingerprint())
    state = ServingState(SERVICE_NAME)
    servicer = TextGenerationServicer(tokenizer, engine, state, args.default_max_tokens)
    server = build_server([SERVICE_NAME], state, servicer.register)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    await state.mark_alive()
    print(f"llmserve-tokenizer listening on {args.host}:{port} (engine {args.engine})", flush=True)
    watcher = asyncio.create_task(keep_health_in_step(engine, state))

    async def stop_watch() -> None:
        watcher.cancel()
        await engine.close()

    await run_until_signalled(server, state, args.grace_period, stop_watch)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model == "":
        args.model = None
    configure_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
