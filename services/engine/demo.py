"""`python -m services.engine.demo`: load the default model (or --model) and generate for three prompts."""

import argparse
import time

from services.engine import LLM, SamplingParams

PROMPTS = ["The three primary colors are", "def is_prime(n: int) -> bool:\n"]
CHAT = [{"role": "user", "content": "Give me two tips for writing clear code."}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF checkpoint directory or .gguf file (default: embedded)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    llm = LLM(args.model)
    print(f"loaded {llm.runner.model_path} on {llm.runner.device} in {time.perf_counter() - started:.1f}s")
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS] + [llm.chat_prompt_ids(CHAT)]
    labels = PROMPTS + [f"[chat] {CHAT[0]['content']}"]
    started = time.perf_counter()
    outputs = llm.generate(prompt_ids, sampling, use_tqdm=False)
    elapsed = time.perf_counter() - started
    for label, output in zip(labels, outputs):
        print(f"\n=== {label!r}\n{output['text']}\n--- {len(output['token_ids'])} tokens, {output['finish_reason']}")
    num_tokens = sum(len(o["token_ids"]) for o in outputs)
    print(f"\n{num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tok/s)")


if __name__ == "__main__":
    main()
