"""Throughput cost of structured output, offline, against unconstrained requests measured in the same run.

    OMP_NUM_THREADS=1 python bench/structured_output.py                       # embedded model, 32 requests
    OMP_NUM_THREADS=1 python bench/structured_output.py --model DIR --requests 64 --rounds 3

The same N chat prompts run three ways, with identical token counts per request (so identical batch shapes
at every step; only the masking differs):
  constrained    every request has a JSON schema (bounded instances) and ends on EOS;
  unconstrained  no constraint; each request generates exactly as many tokens as its constrained twin did
                 (max_tokens = that length, ignore_eos);
  mixed          the first request constrained, the others unconstrained (the price unconstrained rows pay
                 for sharing a batch with a constrained one).
Prints tokens per CPU-second of this process (all its threads; the wall clock on a shared machine is too noisy),
best of --rounds (order rotated each round), the ratio to unconstrained and the share of that time spent in
GrammarMasks.apply (filling and applying the bitmasks). Then
the host time of GrammarMasks.apply on a step of 256 unconstrained rows: what a step without constraints pays.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.core.sequence import Sequence  # noqa: E402

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "name": {"type": "string", "maxLength": 16}},
    "required": ["color", "count", "name"], "additionalProperties": False})
QUESTION = "Describe a thing #{i}: its color, a count and a short name, as JSON."


class MaskTimer:
    """Wraps the runner's GrammarMasks.apply and adds up the CPU time (of this process) spent in it."""

    def __init__(self, masks):
        self.seconds = 0.0
        self._apply = masks.apply
        masks.apply = self

    def __call__(self, logits, seqs) -> None:
        started = time.process_time()
        self._apply(logits, seqs)
        self.seconds += time.process_time() - started


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], timer: MaskTimer
        ) -> tuple[float, float, int, list[dict]]:
    """(CPU seconds of this process, of them in GrammarMasks.apply, generated tokens, outputs) of one batch.

    CPU time, not wall time: on a shared machine other processes stretch the wall clock by 2-3x from run to
    run, and CPU time counts every thread of ours (xgrammar's included)."""
    timer.seconds = 0.0
    started = time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.process_time() - started, timer.seconds, sum(len(output["token_ids"]) for output in outputs), outputs


def variants(n: int, lengths: list[int]) -> dict[str, list[SamplingParams]]:
    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=128, json_schema=SCHEMA) for i in range(n)]
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=lengths[i], ignore_eos=True) for i in range(n)]
    return {"unconstrained": free, "constrained": constrained, "mixed": [constrained[0], *free[1:]]}


def masks_host_time_us(llm: LLM, num_rows: int = 256, repeats: int = 2000) -> float:
    """µs per GrammarMasks.apply call over num_rows unconstrained sequences (no tensor is touched)."""
    seqs = [Sequence(seq_id=i, request_id=str(i), token_ids=[1, 2, 3], sampling=SamplingParams()) for i in range(num_rows)]
    masks = llm.runner.grammar_masks
    started = time.perf_counter()
    for _ in range(repeats):
        masks.apply(None, seqs)
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=max(args.requests, 1), num_kvcache_blocks=max(64, args.requests * 8))
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": QUESTION.format(i=i)}]) for i in range(args.requests)]
    warm = [SamplingParams(temperature=0.8, seed=i, max_tokens=128, json_schema=SCHEMA) for i in range(args.requests)]
    timer = MaskTimer(llm.runner.grammar_masks)
    _, _, _, outputs = run(llm, prompts, warm, timer)  # warm-up; also compiles the schema and fixes each request's length
    assert all(output["finish_reason"] == "stop" for output in outputs), "a constrained request hit max_tokens"
    for output in outputs:
        json.loads(output["text"])
    lengths = [len(output["token_ids"]) for output in outputs]
    runs = variants(args.requests, lengths)
    best: dict[str, float] = {}
    mask_share: dict[str, float] = {}
    names = list(runs)
    for round_index in range(args.rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            seconds, mask_seconds, tokens, _ = run(llm, prompts, runs[name], timer)
            assert tokens == sum(lengths), (name, tokens, sum(lengths))
            if tokens / seconds > best.get(name, 0.0):
                best[name], mask_share[name] = tokens / seconds, mask_seconds / seconds
    print(f"{args.requests} requests, {sum(lengths)} generated tokens each way, best of {args.rounds} rounds")
    for name in names:
        print(f"  {name:<14} {best[name]:8.1f} tok/CPU-s   ratio to unconstrained {best[name] / best['unconstrained']:.3f}"
              f"   time in GrammarMasks.apply {mask_share[name]:.1%}")
    print(f"GrammarMasks.apply on 256 unconstrained rows: {masks_host_time_us(llm):.1f} µs per step")


if __name__ == "__main__":
    main()
