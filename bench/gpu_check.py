"""The GPU check's Python steps (bench/gpu_check.sh runs them in order and prints the table last).

    python bench/gpu_check.py build --shape smollm2 --out DIR          # random-weight checkpoint, fixed seed
    python bench/gpu_check.py equiv --model DIR --out-json F           # GPU bf16 (CUDA graphs) vs CPU fp32
    python bench/gpu_check.py offline --model DIR --out-json F         # nano-vllm's offline workload
    python bench/gpu_check.py hf-slice --model DIR --out-json F        # transformers generate vs ours, a slice
    python bench/gpu_check.py table --results DIR                      # the summary table

Imports only what the GPU machine has (torch, transformers, safetensors, tqdm, xxhash; no gguf). Every
subcommand takes --smoke: tiny shapes and workloads on CPU, to test this script without a GPU.
"""

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {  # Hugging Face config fields; "kind" picks the config class
    "smollm2": dict(kind="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192),
    "qwen3-0.6b": dict(kind="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
    "tiny-llama": dict(kind="llama", vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                       num_attention_heads=6, num_key_value_heads=3, head_dim=16, tie_word_embeddings=True,
                       rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=2048),
    "tiny-qwen3": dict(kind="qwen3", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=2048),
}
# Init measured on CPU at the SmolLM2 shape (fp32 vs bf16 on the same tokens): at HF's default init a random
# model repeats one token; with small embeddings (the current token's own tied embedding must not dominate
# the residual stream), projections at 1.2 / sqrt(fan_in) and the final norm's weight sharpening the logits
# (std ~ 3.6), greedy outputs are diverse, bf16 agrees with fp32 at top-1 on ~92% of positions, and where
# it does not, the fp32 gap was <= 0.11 std and the bf16 pick within the top 3 (this script's equiv step
# with a CPU bf16 target: 2/8 exact, 6 near-ties). Above gain ~1.5 the model is chaotic (bf16 agrees ~50%).
EMBED_STD = 0.02
FINAL_NORM_WEIGHT = 7.5
LAYER_GAIN = 1.2
# A divergence is a near-tie when the pick is in the reference's top 5 and the reference's top-1 leads it by at
# most 0.25 std of the reference's logits; a wrong kernel or a corrupted cache row is off by whole stds.
NEAR_TIE_STDS = 0.25


def random_weights(spec: dict, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named fp32 tensors from one seeded generator (scales: see LAYER_GAIN above)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    q_size, kv_size = spec["num_attention_heads"] * head_dim, spec["num_key_value_heads"] * head_dim

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) * (LAYER_GAIN / math.sqrt(in_features))

    weights = {"model.embed_tokens.weight": torch.randn(spec["vocab_size"], hidden, generator=generator) * EMBED_STD,
               "model.norm.weight": torch.full((hidden,), FINAL_NORM_WEIGHT)}
    if not spec["tie_word_embeddings"]:
        weights["lm_head.weight"] = torch.randn(spec["vocab_size"], hidden, generator=generator) * EMBED_STD
    projections = {"self_attn.q_proj": (q_size, hidden), "self_attn.k_proj": (kv_size, hidden),
                   "self_attn.v_proj": (kv_size, hidden), "self_attn.o_proj": (hidden, q_size),
                   "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {f"{p}{name}.weight": linear(*shape) for name, shape in projections.items()}
        weights |= {p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden)}
        if spec["kind"] == "qwen3":
            weights |= {p + "self_attn.q_norm.weight": torch.ones(head_dim),
                        p + "self_attn.k_norm.weight": torch.ones(head_dim)}
    return weights


def cmd_build(args) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, Qwen3Config

    spec = dict(SHAPES[args.shape])
    marker = os.path.join(args.out, "gpu_check_build.json")
    recipe = json.dumps({"shape": spec, "seed": args.seed, "dtype": args.dtype, "embed_std": EMBED_STD,
                         "final_norm": FINAL_NORM_WEIGHT, "gain": LAYER_GAIN}, sort_keys=True)
    if os.path.exists(marker) and Path(marker).read_text() == recipe:
        print(f"{args.out} already holds this checkpoint")
        return
    config_class, architecture = {"llama": (LlamaConfig, "LlamaForCausalLM"),
                                  "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}[spec["kind"]]
    started = time.perf_counter()
    fields = {k: v for k, v in spec.items() if k != "kind"}
    config = config_class(**fields, architectures=[architecture], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          dtype=args.dtype)
    os.makedirs(args.out, exist_ok=True)
    config.save_pretrained(args.out)
    dtype = getattr(torch, args.dtype)
    weights = {name: t.to(dtype).contiguous() for name, t in random_weights(spec, args.seed).items()}
    save_file(weights, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    Path(marker).write_text(recipe)
    num_params = sum(t.numel() for t in weights.values())
    print(f"built {args.shape}: {num_params / 1e6:.1f}M parameters ({args.dtype}) in {args.out} "
          f"in {time.perf_counter() - started:.1f}s")


def _prompts(smoke: bool, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1234)
    lengths = [5, 12, 21, 30] if smoke else [7, 19, 33, 64, 100, 150, 230, 300]
    outputs = [12, 8, 16, 10] if smoke else [40, 24, 48, 32, 16, 48, 28, 36]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths], outputs


def _greedy(llm, prompts, outputs) -> list[list[int]]:
    from services.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def first_divergence(reference, prompt: list[int], expected: list[int], got: list[int]) -> dict | None:
    """None when equal; else where they part and how close the reference's own logits were there."""
    step = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if step is None:
        return None if len(expected) == len(got) else {"step": min(len(expected), len(got)), "near_tie": False}
    logits = reference.runner.score(prompt + expected[:step])[-1]  # fp32 [V]
    top5 = logits.topk(5).indices.tolist()
    gap = float(logits[expected[step]] - logits[got[step]])
    std = float(logits.std())
    return {"step": step, "expected": expected[step], "got": got[step], "gap": round(gap, 4),
            "gap_over_std": round(gap / std, 4), "got_rank": top5.index(got[step]) if got[step] in top5 else None,
            "near_tie": got[step] in top5 and gap <= NEAR_TIE_STDS * std}


def single_stream_decode_tok_s(llm, vocab_size: int, new_tokens: int) -> float:
    """Batch-1 decode speed: time to the first token subtracted (like bench/decode_latency.py)."""
    from services.engine import SamplingParams

    prompt = [(7 * i + 11) % (vocab_size - 10) + 10 for i in range(128)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], many, use_tqdm=False)
    timings = []
    for params in (one, many):
        _sync()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        timings.append(time.perf_counter() - start)
    return (new_tokens - 1) / max(1e-9, timings[1] - timings[0])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cmd_equiv(args) -> None:
    from services.engine import LLM

    reference = LLM(args.model, device="cpu", dtype="float32", attention_backend="torch", num_kvcache_blocks=512,
                    enable_prefix_caching=False)
    prompts, outputs = _prompts(args.smoke, reference.runner.vocab_size)
    expected = _greedy(reference, prompts, outputs)
    target = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=16, gpu_memory_utilization=0.5)
    runner = target.runner
    got = _greedy(target, prompts, outputs)
    divergences = [first_divergence(reference, p, e, g) for p, e, g in zip(prompts, expected, got)]
    near = [dict(d, prompt=i) for i, d in enumerate(divergences) if d is not None]
    result = {
        "status": "pass" if all(d["near_tie"] for d in near) else "fail",
        "exact": sum(d is None for d in divergences), "total": len(prompts), "divergences": near,
        "device": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu",
        "dtype": str(runner.dtype).removeprefix("torch."), "backend": runner.attention_backend.name,
        "cuda_graphs": runner.graphs is not None, "model": os.path.basename(os.path.normpath(args.model)),
        "distinct_tokens": len({t for ids in expected for t in ids}),
        "decode_tok_s": single_stream_decode_tok_s(target, runner.vocab_size, 32 if args.smoke else 256),
    }
    _write(args.out_json, result)


def _workload_args(args, num_seqs: int) -> argparse.Namespace:
    low, high = (8, 32) if args.smoke else (100, 1024)
    return argparse.Namespace(seed=0, num_seqs=num_seqs, min_input=low, max_input=high, min_output=low, max_output=high)


def _ours_tok_s(args, workload) -> dict:
    from bench.offline import run_llmserve
    from services.engine import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=256)
    elapsed, num_tokens = run_llmserve(llm, workload)
    return {"tok_s": num_tokens / elapsed, "tokens": num_tokens, "seconds": elapsed,
            "preemptions": llm.stats()["num_preemptions"], "cuda_graphs": llm.runner.graphs is not None}


def cmd_offline(args) -> None:
    from bench.offline import make_workload

    workload = make_workload(_workload_args(args, 8 if args.smoke else 256), _vocab_size(args.model))
    _write(args.out_json, _ours_tok_s(args, workload) | {"num_seqs": len(workload)})


def _vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def hf_generate_tok_s(model_dir: str, workload, device: str, dtype: torch.dtype) -> dict:
    """transformers' batched generate over the whole slice in one left-padded batch, sampling like ours
    (temperature 0.6, ignore EOS by min_new_tokens); only each request's own output length counts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device).eval()
    longest_prompt = max(len(p) for p, _ in workload)
    longest_output = max(n for _, n in workload)
    input_ids = torch.zeros(len(workload), longest_prompt, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(workload):
        input_ids[row, longest_prompt - len(prompt):] = torch.tensor(prompt)
        mask[row, longest_prompt - len(prompt):] = 1
    _sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), do_sample=True,
                       temperature=0.6, top_k=0, top_p=1.0, max_new_tokens=longest_output,
                       min_new_tokens=longest_output, pad_token_id=0)
    _sync()
    elapsed = time.perf_counter() - start
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    num_tokens = sum(n for _, n in workload)
    return {"tok_s": num_tokens / elapsed, "tokens": num_tokens, "seconds": elapsed}


def cmd_hf_slice(args) -> None:
    from bench.offline import make_workload

    workload = make_workload(_workload_args(args, 8 if args.smoke else 256), _vocab_size(args.model))
    workload = workload[:args.num_seqs]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    auto_fp32 = args.dtype == "auto" and device == "cpu"  # our "auto": fp32 on CPU, bf16 on GPU
    hf_dtype = torch.float32 if args.dtype in ("float32", "fp32") or auto_fp32 else torch.bfloat16
    theirs = hf_generate_tok_s(args.model, workload, device, hf_dtype)  # first: it frees its memory after
    ours = _ours_tok_s(args, workload)
    _write(args.out_json, {"num_seqs": len(workload), "hf": theirs, "ours": ours,
                           "ratio": ours["tok_s"] / theirs["tok_s"]})


def _write(path: str, result: dict) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    with open(path, "w") as f:
        f.write(text)


def _step(results: Path, name: str) -> tuple[str, dict | None]:
    """(how the step ended, or "not run"; its JSON result if any). Status codes are gpu_check.sh's."""
    rc_file, json_file = results / f"{name}.rc", results / f"{name}.json"
    data = json.loads(json_file.read_text()) if json_file.exists() else None
    if not rc_file.exists():
        return "not run", data
    rc, seconds = (int(x) for x in rc_file.read_text().split())
    states = {0: "ok", 124: f"timeout after {seconds}s", 137: f"killed after {seconds}s", 125: "skipped: no time left"}
    state = states.get(rc, f"failed (rc {rc})")
    return state, data


def table_rows(results: Path) -> tuple[list[tuple[str, str]], bool]:
    """The table's (name, value) rows, and whether every step passed."""
    kernels, _ = _step(results, "kernels")
    log = (results / "kernels.log").read_text() if (results / "kernels.log").exists() else ""
    summary = next((line.strip("= ") for line in reversed(log.splitlines()) if " in " in line and
                    ("passed" in line or "failed" in line or "error" in line)), "")
    rows = [("kernel + gpu_path tests", f"PASS: {summary}" if kernels == "ok" else f"FAIL ({kernels}): {summary}")]
    passed = kernels == "ok"
    warmup, _ = _step(results, "warmup")  # builds ahead of the tests; informational, never judged
    if warmup != "not run":
        log = (results / "warmup.log").read_text() if (results / "warmup.log").exists() else ""
        rows.insert(0, ("warm-up (not judged)", f"{warmup}: {log.strip().splitlines()[-1] if log.strip() else ''}"))
    state, eq = _step(results, "equiv")
    passed &= eq is not None and eq["status"] == "pass"
    if eq:
        ties = eq["divergences"]
        worst = max((d.get("gap_over_std", 0.0) for d in ties), default=0.0)
        rows.append(("GPU vs CPU fp32 greedy", f"{eq['status'].upper()}: {eq['exact']}/{eq['total']} exact, "
                     f"{len(ties)} diverged (max gap {worst:.3f} std; near-tie limit {NEAR_TIE_STDS}) "
                     f"[{eq['device']} {eq['dtype']} {eq['backend']} graphs={eq['cuda_graphs']}]"))
        rows.append(("single-stream decode",
                     f"{eq['decode_tok_s']:.1f} tok/s ({eq['model']}, graphs={eq['cuda_graphs']})"))
    else:
        rows.append(("GPU vs CPU fp32 greedy", f"FAIL {state}"))
    state, off = _step(results, "offline")
    state_hf, hf = _step(results, "hf")
    passed &= off is not None and hf is not None
    if off:
        rows.append((f"offline {off['num_seqs']} seqs, ours", f"{off['tok_s']:.1f} tok/s ({off['tokens']} tokens in "
                     f"{off['seconds']:.1f}s, {off['preemptions']} preemptions, graphs={off['cuda_graphs']})"))
    else:
        rows.append(("offline benchmark, ours", f"FAIL {state}"))
    if hf:
        rows += [(f"HF generate, {hf['num_seqs']}-seq slice", f"{hf['hf']['tok_s']:.1f} tok/s"),
                 (f"ours, same {hf['num_seqs']} seqs", f"{hf['ours']['tok_s']:.1f} tok/s"),
                 ("ratio ours / HF (slice)", f"{hf['ratio']:.2f}x")]
    else:
        rows.append(("HF slice comparison", f"FAIL {state_hf}"))
    return rows, passed


def cmd_table(args) -> None:
    rows, passed = table_rows(Path(args.results))
    width = max(len(name) for name, _ in rows)
    lines = [f"llmserve GPU check: {'ALL PASSED' if passed else 'FAILURES'}", "-" * 72]
    print("\n".join(lines + [f"{name:<{width}}  {value}" for name, value in rows]))
    sys.exit(0 if passed else 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build")
    build.add_argument("--shape", choices=sorted(SHAPES), required=True)
    build.add_argument("--out", required=True)
    build.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    build.add_argument("--seed", type=int, default=0)
    for name, func in (("equiv", cmd_equiv), ("offline", cmd_offline), ("hf-slice", cmd_hf_slice)):
        sub = commands.add_parser(name)
        sub.add_argument("--model", required=True)
        sub.add_argument("--out-json", required=True)
        sub.add_argument("--device", default="auto")
        sub.add_argument("--dtype", default="auto")
        sub.add_argument("--num-seqs", type=int, default=32)
        sub.add_argument("--smoke", action="store_true", help="tiny workload on CPU")
        sub.set_defaults(func=func)
    build.set_defaults(func=cmd_build)
    table = commands.add_parser("table")
    table.add_argument("--results", required=True)
    table.set_defaults(func=cmd_table)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
