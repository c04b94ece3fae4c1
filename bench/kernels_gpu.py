"""Time the Triton attention kernels on serving-sized shapes and print achieved bandwidth against the GPU's.

On the GPU machine, from the repository root:
    python -m bench.kernels_gpu                      # Qwen3-0.6B-like: 16 q heads, 8 KV heads, D 128
    python -m bench.kernels_gpu --block-sizes 16 --batch 64 --context 4096
Each row: our kernel, then the competitor on the same data (torch SDPA on dense, unpaged K/V; flash-attn
when importable), then the ratio. Outputs are checked against the torch references first (--no-check
skips that). `--smoke` runs tiny shapes on CPU under the Triton interpreter to test this script itself.
"""

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

PEAK_GBPS = 4300.0  # H200 device-to-device copy measured here (datasheet: 4800)
PEAK_TFLOPS = 790.0  # H200 dense bf16 matmul measured here (datasheet: ~990)


@dataclass(slots=True)
class Row:
    """One timed kernel: ours and the competitor's time on the same work."""

    kernel: str
    shape: str
    ms: float
    work: float  # bytes or FLOPs done in one call
    unit: str  # "GB/s" or "TFLOP/s"
    their_name: str = ""
    their_ms: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256, help="decode batch size")
    parser.add_argument("--context", type=int, default=1024, help="decode context length per sequence")
    parser.add_argument("--long-batch", type=int, default=4, help="batch of the long-context (split-K) decode case")
    parser.add_argument("--long-context", type=int, default=32768, help="context of the long-context decode case")
    parser.add_argument("--prefill-seqs", type=int, default=4, help="sequences in the prefill cases")
    parser.add_argument("--prefill-len", type=int, default=2048, help="tokens per prefill sequence")
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with the torch references")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.long_batch, args.long_context = 2, 40, 1, 96
        args.prefill_seqs, args.prefill_len, args.q_heads, args.kv_heads, args.head_dim = 2, 24, 4, 2, 64
        args.block_sizes, args.dtype = [16], "float32"
    return args


def timer(device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call: triton's do_bench (L2 flushed, median) on CUDA, one wall-clock call on CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def wall(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def paged_setup(torch, num_seqs, context_len, block_size, args, dtype, device, gen):
    """Random caches holding num_seqs contexts of context_len in shuffled blocks, and the dense copies."""
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(num_seqs, blocks_per_seq)
    block_tables = block_tables.to(torch.int32)

    def dense(cache):  # [B, Hkv, L, D]
        rows = cache[block_tables.long()].flatten(1, 2)[:, :context_len]
        return rows.transpose(1, 2).contiguous()

    return k_cache, v_cache, block_tables, dense(k_cache), dense(v_cache)


def check(name: str, out, ref, atol: float) -> None:
    err = (out.float() - ref.float()).abs().max().item()
    status = "ok" if err <= atol else "MISMATCH"
    print(f"check {name:<34} max abs err {err:.2e} (tol {atol:.0e}) {status}")
    if err > atol:
        raise SystemExit(f"{name}: kernel disagrees with its reference")


def bench_store_kv(torch, k_mod, args, dtype, device, gen, bench) -> list[Row]:
    """Write N new tokens' K/V: decode-sized and prefill-sized batches; bytes read + written."""
    rows = []
    for num_tokens in (args.batch, args.prefill_seqs * args.prefill_len):
        block_size = args.block_sizes[0]
        num_blocks = -(-num_tokens // block_size) + 1
        k = torch.randn(num_tokens, args.kv_heads, args.head_dim, generator=gen, device=device, dtype=dtype)
        v = torch.randn_like(k)
        k_cache = torch.zeros(num_blocks, block_size, args.kv_heads, args.head_dim, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
        if not args.no_check:
            k_ref, v_ref = k_cache.clone(), v_cache.clone()
            k_mod.store_kv(k, v, k_cache, v_cache, slots)
            k_mod.store_kv_reference(k, v, k_ref, v_ref, slots)
            check(f"store_kv N={num_tokens}", k_cache, k_ref, 0.0)
        ms = bench(lambda: k_mod.store_kv(k, v, k_cache, v_cache, slots))

        def theirs():
            k_cache.view(-1, args.kv_heads, args.head_dim).index_copy_(0, slots, k)
            v_cache.view(-1, args.kv_heads, args.head_dim).index_copy_(0, slots, v)

        their_ms = bench(theirs)
        rows.append(Row("store_kv", f"N={num_tokens}", ms, 4 * k.numel() * k.element_size(), "GB/s",
                        "torch index_copy_", their_ms))
    return rows


def bench_decode(torch, d_mod, args, dtype, device, gen, bench, flash) -> list[Row]:
    """Paged decode for each block size, plus one long-context small-batch case that needs split-K."""
    import torch.nn.functional as F

    rows = []
    cases = [(args.batch, args.context, bs) for bs in args.block_sizes]
    cases.append((args.long_batch, args.long_context, args.block_sizes[0]))
    group = args.q_heads // args.kv_heads
    scale = args.head_dim ** -0.5
    for num_seqs, context_len, block_size in cases:
        k_cache, v_cache, tables, k_dense, v_dense = paged_setup(torch, num_seqs, context_len, block_size, args,
                                                                 dtype, device, gen)
        q = torch.randn(num_seqs, args.q_heads, args.head_dim, generator=gen, device=device, dtype=dtype)
        lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
        ours = lambda: d_mod.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)  # noqa: E731
        if not args.no_check:
            ref = d_mod.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
            check(f"decode B={num_seqs} L={context_len} bs={block_size}", ours(), ref, 2e-2)
        q_dense = q.view(num_seqs, args.kv_heads, group, args.head_dim)
        theirs = lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale)  # noqa: E731
        their_name, their_ms = "sdpa dense", bench(theirs)
        if flash is not None and block_size % 256 == 0:
            their_name = "flash_attn_with_kvcache"
            their_ms = bench(lambda: flash.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=lens,
                                                                   block_table=tables, softmax_scale=scale))
        kv_bytes = 2 * k_dense.numel() * k_dense.element_size()
        splits, _ = d_mod.plan_splits(num_seqs, args.kv_heads, tables.shape[1] * block_size, 64, device)
        rows.append(Row("decode", f"B={num_seqs} L={context_len} bs={block_size} splits={splits}", bench(ours),
                        kv_bytes, "GB/s", their_name, their_ms))
    return rows


def causal_flops(num_new: int, context_len: int, args) -> float:
    """QK^T and PV multiply-adds of causal attention for num_new queries at the end of a context."""
    visible = num_new * (context_len - num_new) + num_new * (num_new + 1) // 2
    return 4.0 * args.head_dim * args.q_heads * visible


def prefill_inputs(torch, block_size, args, dtype, device, gen):
    """(args, kwargs) of prefill_attention and the dense q, k, v [B, H, L, D] for one prefill case.

    block_size None: whole prompts, flat K/V. Otherwise the first half of each prompt is cached.
    """
    num_seqs, context_len = args.prefill_seqs, args.prefill_len
    num_new = context_len if block_size is None else context_len // 2
    k_cache, v_cache, tables, k_dense, v_dense = paged_setup(torch, num_seqs, context_len, block_size or 16, args,
                                                             dtype, device, gen)
    q_dense = torch.randn(num_seqs, args.q_heads, num_new, args.head_dim, generator=gen, device=device, dtype=dtype)
    q = q_dense.transpose(1, 2).reshape(-1, args.q_heads, args.head_dim).contiguous()  # [N, Hq, D]
    cu_q = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * num_new
    cu_k = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * context_len
    scale = args.head_dim ** -0.5
    if block_size is None:
        k, v = (t.transpose(1, 2).reshape(-1, args.kv_heads, args.head_dim).contiguous() for t in (k_dense, v_dense))
        return (q, k, v, cu_q, cu_q, num_new, scale), {}, (q_dense, k_dense, v_dense)
    call_args = (q, k_cache, v_cache, cu_q, cu_k, num_new, scale)
    return call_args, {"block_tables": tables}, (q_dense, k_dense, v_dense)


def bench_prefill(torch, p_mod, args, dtype, device, gen, bench, flash) -> list[Row]:
    """Prefill with no cached prefix (flat K/V) and with half of each prompt cached (paged, per block size)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    rows, group = [], args.q_heads // args.kv_heads
    for block_size in [None, *args.block_sizes]:
        call_args, call_kwargs, (q_dense, k_dense, v_dense) = prefill_inputs(torch, block_size, args, dtype,
                                                                            device, gen)
        q, k, v, cu_q, cu_k, num_new, scale = call_args
        context_len = k_dense.shape[2]
        shape = f"B={args.prefill_seqs} new={num_new} L={context_len} " + (f"bs={block_size}" if block_size
                                                                          else "flat")
        ours = lambda: p_mod.prefill_attention(*call_args, **call_kwargs)  # noqa: E731
        if not args.no_check:
            check(f"prefill {shape}", ours(), p_mod.prefill_attention_reference(q, k, v, cu_q, cu_k, scale,
                                                                                 **call_kwargs), 2e-2)
        k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k_dense, v_dense))
        mask = causal_lower_right(num_new, context_len)
        their_name = "sdpa dense causal"
        their_ms = bench(lambda: F.scaled_dot_product_attention(q_dense, k_rep, v_rep, attn_mask=mask, scale=scale))
        if flash is not None and block_size is not None and block_size % 256 == 0:
            their_name = "flash_attn_varlen_func"
            their_ms = bench(lambda: flash.flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, num_new, context_len, softmax_scale=scale, causal=True,
                block_table=call_kwargs["block_tables"]))
        rows.append(Row("prefill", shape, bench(ours), causal_flops(num_new, context_len, args) * args.prefill_seqs,
                        "TFLOP/s", their_name, their_ms))
    return rows


def print_table(rows: list[Row], on_gpu: bool) -> None:
    print(f"\n{'kernel':<9}{'shape':<38}{'ours ms':>9}{'rate':>16}{'% peak':>8}  {'theirs':<24}{'ms':>9}"
          f"{'theirs/ours':>12}")
    for row in rows:
        per_s = row.work / (row.ms * 1e-3)
        rate, peak = (per_s / 1e9, PEAK_GBPS) if row.unit == "GB/s" else (per_s / 1e12, PEAK_TFLOPS)
        pct = f"{100 * rate / peak:.0f}%" if on_gpu else "-"
        print(f"{row.kernel:<9}{row.shape:<38}{row.ms:>9.3f}{rate:>9.1f} {row.unit:<7}{pct:>7}  "
              f"{row.their_name:<24}{row.their_ms:>9.3f}{row.their_ms / row.ms:>12.2f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from services.engine.kernels import decode_attention, prefill_attention, store_kv

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on the GPU machine, or pass --smoke for a CPU dry run")
    try:
        import flash_attn
    except ImportError:
        flash_attn = None
    dtype, gen, bench = getattr(torch, args.dtype), torch.Generator(device=device).manual_seed(0), timer(device)
    block_m, block_n = prefill_attention.prefill_tiles(dtype, args.head_dim)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}, "
          f"Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}, prefill tiles {block_m}x{block_n}, "
          f"flash-attn {'yes' if flash_attn else 'no'}")
    rows = bench_store_kv(torch, store_kv, args, dtype, device, gen, bench)
    rows += bench_decode(torch, decode_attention, args, dtype, device, gen, bench, flash_attn)
    rows += bench_prefill(torch, prefill_attention, args, dtype, device, gen, bench, flash_attn)
    print_table(rows, device.type == "cuda")


if __name__ == "__main__":
    main()
