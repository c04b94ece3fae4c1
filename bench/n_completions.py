"""What sampling.n = 4 and best_of = 4 cost against four separate requests with the same prompt, offline, in one run.

    python bench/tiny_model.py /tmp/tiny && python bench/n_completions.py --model /tmp/tiny
    python bench/n_completions.py --model embedded --prompt-lens 32 256 --tokens 16 --repeats 3

For each prompt length, every configuration generates `--tokens` tokens for each of 4 completions (ignore_eos,
seeded so the work is the same): "n=4" is one request with n=4 (prompt prefilled once, siblings from the prefix
cache), "best_of=4" is one request with n=1 and best_of=4 (the same work, plus the sampled tokens' logprobs, the
hold-back and the ranking; one completion returned), "4 reqs" is four requests each prefilling the prompt (each
run gets a fresh scheduler, so no prefix cache is shared between runs or configurations). They alternate within
each repeat and the medians are reported, with the engine's prompt-token counters of one run of each, so load
from other processes hits all alike.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import LLM, SamplingParams  # noqa: E402

N = 4
CONFIGS = ("n=4", "best_of=4", "4 reqs")


def _requests(config: str, prompt: list[int], tokens: int) -> tuple[list[list[int]], object]:
    common = dict(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    if config == "n=4":
        return [prompt], SamplingParams(seed=0, n=N, **common)
    if config == "best_of=4":
        return [prompt], SamplingParams(seed=0, n=1, best_of=N, **common)
    return [prompt] * N, [SamplingParams(seed=i, **common) for i in range(N)]


def _run(llm: LLM, prompt: list[int], tokens: int, config: str) -> tuple[float, dict]:
    fresh = llm.with_scheduler(enable_prefix_caching=True)  # an empty prefix cache for every run
    prompts, params = _requests(config, prompt, tokens)
    started = time.perf_counter()
    fresh.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, fresh.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (bench/tiny_model.py writes one), or 'embedded' for the default")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = None if args.model == "embedded" else args.model
    llm = LLM(model, max_model_len=max(args.prompt_lens) + args.tokens + 16, num_kvcache_blocks=512)
    print(f"{'prompt':>6} " + " ".join(f"{c + ' s':>11}" for c in CONFIGS)
          + f" {'4 reqs/n=4':>10} {'best_of/n=4':>11}  prompt tokens computed/cached ({' | '.join(CONFIGS)})")
    for length in args.prompt_lens:
        prompt = [(7 * i + 11) % 400 + 5 for i in range(length)]
        _run(llm, prompt, args.tokens, "n=4")  # warm-up
        times: dict[str, list[float]] = {c: [] for c in CONFIGS}
        stats = {}
        for _ in range(args.repeats):
            for config in CONFIGS:
                seconds, stats[config] = _run(llm, prompt, args.tokens, config)
                times[config].append(seconds)
        medians = {c: statistics.median(times[c]) for c in CONFIGS}
        counts = " | ".join(f"{stats[c]['num_computed_prompt_tokens']}/{stats[c]['num_cached_prompt_tokens']}"
                            for c in CONFIGS)
        apart, best_of = (medians[c] / medians["n=4"] for c in ("4 reqs", "best_of=4"))
        print(f"{length:>6} " + " ".join(f"{medians[c]:>11.3f}" for c in CONFIGS)
              + f" {apart:>9.2f}x {best_of:>10.2f}x  {counts}")


if __name__ == "__main__":
    main()
