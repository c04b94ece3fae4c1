"""CPU µs per token of incremental detokenization: tokenizers' DecodeStream vs the Python window method.

    python bench/detokenize.py                  # the embedded model's tokenizer, 64 streams of ~500 tokens
    python bench/detokenize.py --chunk 4        # ids arriving 4 per message (a coalesced stream)

Both methods turn the same id streams (real text in several scripts, plus random vocabulary ids) into the
same deltas (checked here); the ratio window / stream is printed last.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.tokenizer.detokenizer import IncrementalDetokenizer  # noqa: E402
from services.tokenizer.tokenizer import TextTokenizer  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. def area(r): return 3.14159 * r ** 2  # ✓ "
        "東京は日本の首都です。 Party 🎉🥳 ภาษาไทย naïve café, привет, مرحبا. ")


def workloads(tok: TextTokenizer, num_streams: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per stream: half real text, half random vocabulary ids."""
    rng = random.Random(seed)
    text_ids = tok.encode(TEXT * 12, add_special_tokens=False)
    streams = []
    for i in range(num_streams):
        if i % 2 == 0:
            start = rng.randrange(len(text_ids) // 2)
            output = text_ids[start : start + 500]
        else:
            output = [rng.randrange(tok.vocab_size) for _ in range(500)]
        streams.append((tok.encode("Write something:"), output))
    return streams


def run(tok, streams, chunk: int, use_decode_stream: bool) -> tuple[float, list[list[str]]]:
    """(CPU seconds, the deltas of every stream)."""
    outputs = []
    start = time.process_time()
    for prompt_ids, output_ids in streams:
        detok = IncrementalDetokenizer(tok, prompt_ids, use_decode_stream=use_decode_stream)
        deltas = [detok.step(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
        deltas.append(detok.flush())
        outputs.append(deltas)
    return time.process_time() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="tokenizer source (default: the embedded model)")
    parser.add_argument("--num-streams", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=1, help="ids per step() call")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per method")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tok = TextTokenizer.load(args.model)
    streams = workloads(tok, args.num_streams, args.seed)
    num_tokens = sum(len(output) for _, output in streams)
    best = {}
    for use_stream in (True, False) * args.repeats:
        seconds, outputs = run(tok, streams, args.chunk, use_stream)
        best[use_stream] = min(seconds, best.get(use_stream, float("inf")))
        best.setdefault(("out", use_stream), outputs)
    assert best[("out", True)] == best[("out", False)], "the two methods disagree"
    stream_us, window_us = (best[m] / num_tokens * 1e6 for m in (True, False))
    print(f"{num_tokens} tokens in {args.num_streams} streams, {args.chunk} id(s) per step, best of {args.repeats}")
    print(f"DecodeStream   {stream_us:6.2f} µs/token")
    print(f"window decode  {window_us:6.2f} µs/token")
    print(f"ratio window / DecodeStream: {window_us / stream_us:.2f}x")


if __name__ == "__main__":
    main()
