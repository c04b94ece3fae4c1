"""CPU µs per streamed token in the tokenizer service, against a real engine service on a tiny random model.

    python bench/tokenizer_relay.py                          # this tree, 1 worker, 256 streams
    python bench/tokenizer_relay.py --workers 2
    python bench/tokenizer_relay.py --code /tmp/before       # another tree's tokenizer service (git archive)
    python bench/tokenizer_relay.py --gc-pauses              # also each service process's garbage collections

The engine serves a random 2-layer, 64-wide Llama carrying the embedded model's tokenizer (so the model costs
almost nothing and the path around it shows). A load generator in its own process keeps --concurrency greedy
streams (ignore_eos) open until --num-requests are done. The tokenizer service's CPU time (all its processes,
from /proc) over the load, divided by the tokens the clients received, is the figure; the engine service's is
printed beside it, with its fronts' part (all its processes but the engine-core one), and the client messages
per token show how much the relay coalesced. Runs at two or more --max-tokens separate each service's cost per
request from its cost per token (CPU per token = per token + per request / tokens per request).

With --gc-pauses every service process records its garbage collections (bench/gc_probe/sitecustomize.py), and
those that ran during the load are summed per process: a full collection stalls every stream of its process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
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


GC_PROBE = REPO_ROOT / "bench" / "gc_probe"
GC_PROBE_PERIOD_S = 1.0  # how often a probed process rewrites its record


def probe_gc(directory: Path) -> None:
    """Make the service processes started from now on record their collections in `directory`."""
    directory.mkdir()
    os.environ["LLMSERVE_GC_PROBE_DIR"] = str(directory)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GC_PROBE), os.environ.get("PYTHONPATH")]))


def gc_pauses(directory: Path, start: float, end: float) -> str:
    """Per service process, its collections that began between `start` and `end` (time.monotonic)."""
    lines = ["  garbage collections during the load:"]
    for path in sorted(directory.glob("*.json")):
        record = json.loads(path.read_text())
        name = record["process"] if record["process"] != "MainProcess" else record["argv"][0]
        during = [(generation, seconds) for began, generation, seconds in record["collections"] if start <= began <= end]
        full = [seconds * 1e3 for generation, seconds in during if generation == 2]
        young = sum(seconds for generation, seconds in during if generation < 2) * 1e3
        lines.append(f"    {path.stem} {name}: {len(full)} full, longest {max(full, default=0):.1f} ms, "
                     f"{sum(full):.1f} ms in all; {len(during) - len(full)} young, {young:.1f} ms in all")
    return "\n".join(lines)


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
    parser.add_argument("--gc-pauses", action="store_true", help="report each service process's garbage collections")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-llama"
        build_checkpoint(model)
        if args.gc_pauses:
            probe_gc(Path(tmp) / "gc")
        services = Services(model, args.code.resolve(), args.workers, max_num_seqs=args.concurrency)
        try:
            run_load(services.tokenizer.target, argparse.Namespace(**{**vars(args), "num_requests": 16}))  # warm-up
            meter = CpuMeter({"tokenizer": services.tokenizer.proc.pid, "engine": services.engine.proc.pid,
                              "core": largest_descendant(services.engine.proc.pid)})
            meter.start()
            load_start = time.monotonic()
            report = run_load(services.tokenizer.target, args)
            load_end = time.monotonic()
            cpu = meter.stop()
            if args.gc_pauses:
                time.sleep(GC_PROBE_PERIOD_S * 1.5)  # every process rewrites its record once more
        finally:
            services.stop()
        if args.gc_pauses:
            gc_report = gc_pauses(Path(tmp) / "gc", load_start, load_end)
    tokens = report["tokens"]
    print(f"tokenizer service ({args.code}, {args.workers} worker(s)): {args.num_requests} requests x "
          f"{args.max_tokens} tokens, {args.concurrency} streams{', slow reader' if args.slow_reader else ''}")
    print(f"  tokens {tokens}, {report['tokens_per_s']:.0f} tok/s, client messages per token "
          f"{report['messages'] / tokens:.3f}")
    print(f"  gaps between a stream's messages: p50 {report['gap_p50_ms']:.1f} ms, p99 {report['gap_p99_ms']:.1f} ms, "
          f"longest {report['gap_max_ms']:.1f} ms")
    fronts = cpu["engine"] - cpu["core"]
    print(f"  tokenizer service CPU {cpu['tokenizer']:.2f} s = {cpu['tokenizer'] / tokens * 1e6:.1f} µs/token; "
          f"engine service CPU {cpu['engine'] / tokens * 1e6:.1f} µs/token, of which its fronts (all but the "
          f"engine-core process) {fronts / tokens * 1e6:.1f} µs/token = {fronts / args.num_requests * 1e3:.2f} ms "
          f"per request")
    if args.gc_pauses:
        print(gc_report)


if __name__ == "__main__":
    main()
