"""CPU µs per streamed token in the tokenizer service, against a real engine service on a tiny random model.

    python bench/tokenizer_relay.py                          # this tree, 1 worker, 256 streams
    python bench/tokenizer_relay.py --workers 2
    python bench/tokenizer_relay.py --code /tmp/before       # another tree's tokenizer service (git archive)

The engine serves a random 2-layer, 64-wide Llama carrying the embedded model's tokenizer (so the model costs
almost nothing and the path around it shows). A load generator in its own process keeps --concurrency greedy
streams (ignore_eos) open until --num-requests are done. The tokenizer service's CPU time (all its processes,
from /proc) over the load, divided by the tokens the clients received, is the figure; the engine service's is
printed beside it, with its fronts' part (all its processes but the engine-core one), and the client messages
per token show how much the relay coalesced. Runs at two or more --max-tokens separate each service's cost per
request from its cost per token (CPU per token = per token + per request / tokens per request).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.proc_cpu import CpuMeter, largest_descendant  # noqa: E402
from tests.services.procs import LoggedProcess, ServiceProcess, wait_health  # noqa: E402


def build_checkpoint(path: Path) -> None:
    """A random tiny Llama with the embedded model's tokenizer (so both services agree on the fingerprint)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.tokenizer.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.load(None).hf_tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))


class Services:
    """An engine and a tokenizer service (from `code`, a source tree) on the checkpoint."""

    def __init__(self, model: Path, code: Path, workers: int, max_num_seqs: int):
        self.engine = ServiceProcess("engine", ["--model", str(model), "--max-model-len", "1024",
                                                "--max-num-seqs", str(max_num_seqs), "--num-kvcache-blocks", "4096",
                                                "--max-num-batched-tokens", "8192", "--grace-period", "1"])
        wait_health(self.engine.target, "llmserve.engine.v1.EngineService", process=self.engine)
        args = ["--engine", self.engine.target, "--model", str(model), "--grace-period", "1"]
        if workers > 1:
            args += ["--workers", str(workers)]
        self.tokenizer = ServiceProcess("tokenizer", args) if code == REPO_ROOT else OtherTreeService(code, args)
        wait_health(self.tokenizer.target, "llmserve.textgen.v1.TextGenerationService", process=self.tokenizer)

    def stop(self) -> None:
        self.tokenizer.stop()
        self.engine.stop()


class OtherTreeService(ServiceProcess):
    """The tokenizer service of another source tree (e.g. `git archive <commit> | tar -x -C /tmp/before`)."""

    def __init__(self, code: Path, args: list[str]):
        run_from = (f"import sys, runpy; sys.path.insert(0, {str(code)!r}); "
                    "runpy.run_module('services.tokenizer', run_name='__main__', alter_sys=True)")
        LoggedProcess.__init__(self, "tokenizer", [sys.executable, "-c", run_from, "--host", "127.0.0.1",
                                                   "--port", "0", *args])
        self._port = None


def run_load(target: str, args) -> dict:
    """Run the load generator (its own process) and return its JSON report."""
    command = [sys.executable, "-m", "bench.relay_load", target, str(args.num_requests), str(args.concurrency),
               str(args.max_tokens)]
    if args.slow_reader:
        command.append("--slow")
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "clients" / "python")})
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, default=REPO_ROOT, help="source tree of the tokenizer service")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slow-reader", action="store_true", help="clients pause 20 ms every 8 messages")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-llama"
        build_checkpoint(model)
        services = Services(model, args.code.resolve(), args.workers, max_num_seqs=args.concurrency)
        try:
            run_load(services.tokenizer.target, argparse.Namespace(**{**vars(args), "num_requests": 16}))  # warm-up
            meter = CpuMeter({"tokenizer": services.tokenizer.proc.pid, "engine": services.engine.proc.pid,
                              "core": largest_descendant(services.engine.proc.pid)})
            meter.start()
            report = run_load(services.tokenizer.target, args)
            cpu = meter.stop()
        finally:
            services.stop()
    tokens = report["tokens"]
    print(f"tokenizer service ({args.code}, {args.workers} worker(s)): {args.num_requests} requests x "
          f"{args.max_tokens} tokens, {args.concurrency} streams{', slow reader' if args.slow_reader else ''}")
    print(f"  tokens {tokens}, {report['tokens_per_s']:.0f} tok/s, client messages per token "
          f"{report['messages'] / tokens:.3f}")
    fronts = cpu["engine"] - cpu["core"]
    print(f"  tokenizer service CPU {cpu['tokenizer']:.2f} s = {cpu['tokenizer'] / tokens * 1e6:.1f} µs/token; "
          f"engine service CPU {cpu['engine'] / tokens * 1e6:.1f} µs/token, of which its fronts (all but the "
          f"engine-core process) {fronts / tokens * 1e6:.1f} µs/token = {fronts / args.num_requests * 1e3:.2f} ms "
          f"per request")


if __name__ == "__main__":
    main()
