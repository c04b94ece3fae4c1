"""What sampling.n = 4 costs against four separate requests with the same prompt, offline, measured in one run.

    python bench/tiny_model.py /tmp/tiny && python bench/n_completions.py --model /tmp/tiny

For each prompt length, both configurations generate `--tokens` tokens per completion (ignore_eos, seeded so the
work is the same): "n=4" is one request with n=4 (prompt prefilled once, siblings from the prefix cache), "4 reqs"
is four requests each prefilling the prompt (each run gets a fresh scheduler, so no prefix cache is shared
between runs or configurations). They alternate within each repeat and the medians are reported, with the
engine's prompt-token counters of one run of each, so load from other processes hits both alike.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import LLM, SamplingParams  # noqa: E402

N = 4


def _run(llm: LLM, prompt: list[int], tokens: int, together: bool) -> tuple[float, dict]:
    fresh = llm.with_scheduler(enable_prefix_caching=True)  # an empty prefix cache for every run
    if together:
        prompts, params = [prompt], SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, n=N)
    else:
        prompts = [prompt] * N
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True) for i in range(N)]
    started = time.perf_counter()
    fresh.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, fresh.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory (bench/tiny_model.py writes one)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=max(args.prompt_lens) + args.tokens + 16, num_kvcache_blocks=512)
    print(f"{'prompt':>6} {'n=4 s':>8} {'4 reqs s':>9} {'ratio':>6}  prompt tokens computed/cached (n=4 | 4 reqs)")
    for length in args.prompt_lens:
        prompt = [(7 * i + 11) % 400 + 5 for i in range(length)]
        _run(llm, prompt, args.tokens, True)  # warm-up
        times = {True: [], False: []}
        stats = {}
        for _ in range(args.repeats):
            for together in (True, False):
                seconds, stats[together] = _run(llm, prompt, args.tokens, together)
                times[together].append(seconds)
        together, apart = statistics.median(times[True]), statistics.median(times[False])
        counts = " | ".join(f"{stats[k]['num_computed_prompt_tokens']}/{stats[k]['num_cached_prompt_tokens']}"
                            for k in (True, False))
        print(f"{length:>6} {together:>8.3f} {apart:>9.3f} {apart / together:>5.2f}x  {counts}")


if __name__ == "__main__":
    main()
