"""Write new tokens' keys and values into the paged KV cache (Triton), beside its torch reference."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    block_size,
    HEAD_DIM: tl.constexpr,
    NUM_ELEMS: tl.constexpr,  # Hkv * D
    BLOCK: tl.constexpr,  # next power of two >= NUM_ELEMS
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # NOTE: padded rows carry slot -1; their store is masked off entirely.
    mask = offs < tl.where(slot >= 0, NUM_ELEMS, 0)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    safe_slot = tl.maximum(slot, 0)
    block_id = safe_slot // block_size
    block_off = safe_slot % block_size

    k = tl.load(k_ptr + token * stride_kn + head * stride_kh + dim * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vn + head * stride_vh + dim * stride_vd, mask=mask)
    kc = k_cache_ptr + block_id * stride_kc_block + block_off * stride_kc_slot
    vc = v_cache_ptr + block_id * stride_vc_block + block_off * stride_vc_slot
    tl.store(kc + head * stride_kc_head + dim * stride_kc_dim, k, mask=mask)
    tl.store(vc + head * stride_vc_head + dim * stride_vc_dim, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, Hkv, D] into k_cache, v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [N].

    Slots < 0 are skipped (padded rows). k, v may be strided views (e.g. slices of a fused qkv output).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    num_elems = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1],
        HEAD_DIM=head_dim, NUM_ELEMS=num_elems, BLOCK=triton.next_power_of_2(num_elems),
    )


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Plain-torch store_kv: the same contract, one indexed copy per cache."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)
