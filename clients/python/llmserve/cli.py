"""The `llmserve` command: generate (streamed), health, tokenize and info against a tokenizer service."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from llmserve.client import DEFAULT_TARGET, SERVICE_NAME, TARGET_ENV, LLMServeClient, resolve_target
from llmserve.datatypes import ChatMessage, ServingStatus
from llmserve.errors import LLMServeError

EXIT_OK = 0
EXIT_FAILURE = 1  # the server answered with an error, or health is not SERVING
EXIT_USAGE = 2  # bad command line (argparse's own code)
EXIT_INTERRUPTED = 130

EPILOG = f"""exit codes: {EXIT_OK} ok; {EXIT_FAILURE} call failed (status code and field violations on stderr) or
not SERVING; {EXIT_USAGE} bad arguments; {EXIT_INTERRUPTED} interrupted. Target: --target, else ${TARGET_ENV},
else {DEFAULT_TARGET}."""


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help=f"host:port (default ${TARGET_ENV} or {DEFAULT_TARGET})")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")


def _add_generate(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="generate text, streamed as it arrives", epilog=EPILOG)
    parser.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    _add_common(parser)
    parser.add_argument("--temperature", type=float, help="0 = greedy")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--min-tokens", type=int)
    parser.add_argument("--logprobs", type=int, metavar="N",
                        help="also report each token's log-probability and its N most likely alternatives (0-20); "
                             "printed on stderr after the text, or in --json")
    parser.add_argument("--prompt-logprobs", type=int, metavar="K",
                        help="also report each prompt token's log-probability and its K most likely alternatives "
                             "(0-20); printed on stderr before the generated tokens' logprobs, or in --json")
    parser.add_argument("--n", type=int, help="number of completions (1-16), printed one after another")
    parser.add_argument("--best-of", type=int, metavar="K",
                        help="generate K completions (n-16) and keep the n most likely (whole, not streamed)")
    parser.add_argument("--repetition-penalty", type=float, help="> 0; 1 = off (transformers' definition)")
    parser.add_argument("--presence-penalty", type=float, help="[-2, 2]; 0 = off (OpenAI's definition)")
    parser.add_argument("--frequency-penalty", type=float, help="[-2, 2]; 0 = off (OpenAI's definition)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    parser.add_argument("--ignore-eos", action="store_const", const=True, default=None)
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema file")
    constraint.add_argument("--regex", help="constrain the output to match this regular expression")
    constraint.add_argument("--grammar", metavar="FILE", help="constrain the output to this EBNF grammar file")
    constraint.add_argument("--json-object", action="store_const", const=True, default=None,
                            help="constrain the output to a JSON object")
    parser.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--include-stop-str", action="store_const", const=True, default=None)
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    parser.add_argument("--system", help="a system message before the prompt (implies --chat)")
    parser.add_argument("--request-id", help="request id to use (default: the server makes one)")
    parser.add_argument("--json", action="store_true", help="print the final result as JSON instead of streaming")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `llmserve` command."""
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__, epilog=EPILOG)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    health = subparsers.add_parser("health", help="exit 0 if the service is SERVING", epilog=EPILOG)
    _add_common(health)
    health.add_argument("--service", default=SERVICE_NAME, help='service to check ("" = liveness)')
    tokenize = subparsers.add_parser("tokenize", help="print the token ids of a text", epilog=EPILOG)
    tokenize.add_argument("text")
    _add_common(tokenize)
    tokenize.add_argument("--add-special-tokens", action=argparse.BooleanOptionalAction, default=None)
    tokenize.add_argument("--json", action="store_true", help="print token ids and token strings as JSON")
    info = subparsers.add_parser("info", help="describe the served model", epilog=EPILOG)
    _add_common(info)
    info.add_argument("--json", action="store_true", help="print as JSON")
    return parser


def _generate(client: LLMServeClient, args: argparse.Namespace) -> int:
    options: dict[str, Any] = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "min_tokens": args.min_tokens,
        "num_logprobs": args.logprobs,
        "num_prompt_logprobs": args.prompt_logprobs,
        "n": args.n,
        "best_of": args.best_of,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id,
        "skip_special_tokens": args.skip_special_tokens,
        "include_stop_str_in_output": args.include_stop_str,
        "request_id": args.request_id,
        "json_schema": _read_file(args.json_schema),
        "regex": args.regex,
        "grammar": _read_file(args.grammar),
        "json_object": args.json_object,
    }
    if args.chat or args.system is not None:
        messages = [ChatMessage("user", args.prompt)]
        if args.system is not None:
            messages.insert(0, ChatMessage("system", args.system))
        stream = client.generate(messages=messages, timeout=args.timeout, **options)
    else:
        stream = client.generate(args.prompt, timeout=args.timeout, **options)
    with stream:
        if args.json:
            print(json.dumps(stream.result().to_dict(), ensure_ascii=False, indent=2))
            return EXIT_OK
        if args.n is not None and args.n > 1:
            for completion in stream.result().completions:
                print(f"[{completion.index}] {completion.text}")
            return EXIT_OK
        last = ""
        try:
            for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
                last = delta
            result = stream.result()
        except BaseException:
            if last and not last.endswith("\n"):
                print(flush=True)  # keep the error message off the partial line
            raise
    if not last.endswith("\n"):
        print()
    if result.prompt_logprobs:
        print("prompt:", file=sys.stderr)
        _print_logprobs(result.prompt_logprobs)
    if result.logprobs:
        if result.prompt_logprobs:
            print("completion:", file=sys.stderr)
        _print_logprobs(result.logprobs)
    return EXIT_OK


def _read_file(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as exc:
        raise SystemExit(f"llmserve: error: cannot read {path}: {exc.strerror}") from None


def _print_logprobs(logprobs: list) -> None:
    """One line per token on stderr: its logprob and text, then the alternatives (a dash for the first prompt
    token, which has no logprob)."""
    for position in logprobs:
        sampled = position.sampled
        alternatives = "  ".join(f"{entry.text!r} {entry.logprob:.3f}" for entry in position.top)
        if sampled is not None:
            line = f"{sampled.logprob:9.4f} {sampled.text!r:<16}"
        else:
            line = f"{'-':>9} {'(no context)':<16}"
        print(f"{line}  | {alternatives}" if alternatives else line, file=sys.stderr)


def _health(client: LLMServeClient, args: argparse.Namespace) -> int:
    status = client.health(args.service, timeout=args.timeout)
    print(status.name)
    return EXIT_OK if status == ServingStatus.SERVING else EXIT_FAILURE


def _tokenize(client: LLMServeClient, args: argparse.Namespace) -> int:
    result = client.tokenize(args.text, add_special_tokens=args.add_special_tokens, timeout=args.timeout)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "tokens": result.tokens}, ensure_ascii=False))
    else:
        print(" ".join(str(token_id) for token_id in result.token_ids))
    return EXIT_OK


def _info(client: LLMServeClient, args: argparse.Namespace) -> int:
    info = client.model_info(timeout=args.timeout)
    fields = {
        "model_name": info.model_name,
        "architecture": info.architecture,
        "vocab_size": info.vocab_size,
        "max_model_len": info.max_model_len,
        "eos_token_ids": list(info.eos_token_ids),
        "bos_token_id": info.bos_token_id,
        "has_chat_template": info.has_chat_template,
        "default_sampling": info.default_sampling,
    }
    if args.json:
        print(json.dumps(fields, ensure_ascii=False, indent=2))
    else:
        for name, value in fields.items():
            print(f"{name + ':':<19} {value}")
    return EXIT_OK


COMMANDS = {"generate": _generate, "health": _health, "tokenize": _tokenize, "info": _info}


def _report(err: LLMServeError) -> None:
    lines = [f"llmserve: error: {err.code_name}: {err.message}" if err.message else f"llmserve: error: {err.code_name}"]
    lines += [f"  {violation.field}: {violation.description}" for violation in err.field_violations]
    if err.retry_delay_s is not None:
        lines.append(f"  retry after {err.retry_delay_s:g}s")
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    args = build_parser().parse_args(argv)
    try:
        with LLMServeClient(resolve_target(args.target)) as client:
            return COMMANDS[args.command](client, args)
    except LLMServeError as err:
        sys.stdout.flush()
        _report(err)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): silence the interpreter's own flush error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
