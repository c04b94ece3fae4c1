"""CUDA-graph bookkeeping on CPU: the batch-size ladder, padding choice, static buffers, and a decode through
the buffers (a recorded graph replaced by an eager call) against the plain eager decode."""

import pytest
import torch

from services.engine.runner.cuda_graphs import (
    PAD_CONTEXT_LEN, PAD_SLOT, DecodeGraphBuffers, DecodeGraphs, estimate_cuda_graph_bytes, graph_batch_sizes,
    padded_batch_size)
from services.engine.runner.inputs import build_decode, build_prefill, to_model_inputs
from services.engine.runner.kv_cache import allocate_kv_cache, bind_kv_cache
from tests.runner.helpers import make_seq

CPU = torch.device("cpu")


def test_ladder_is_powers_of_two_then_multiples_of_16_up_to_max_num_seqs():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_ladder_is_capped_so_huge_batches_run_eagerly():
    sizes = graph_batch_sizes(4096)
    assert sizes[-1] == 512 and len(sizes) == 4 + 32
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padding_picks_the_smallest_captured_size_that_fits():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == \
        [1, 2, 4, 8, 8, 16, 16, 32, 48, 64]
    assert padded_batch_size(65, sizes) is None


def test_graph_memory_estimate():
    assert estimate_cuda_graph_bytes(1000, 50_000, 300, 10) == 1000 + 50_000 + 9 * 300
    assert estimate_cuda_graph_bytes(1000, 50_000, -20, 1) == 51_000  # a negative reading counts as 0
    assert estimate_cuda_graph_bytes(1000, 50_000, 300, 0) == 0


def _decode_seqs(block_size: int = 4):
    return [make_seq(0, list(range(10, 15)), [6, 2], num_cached_tokens=4),
            make_seq(1, list(range(20, 29)), [1, 5, 3], num_cached_tokens=8),
            make_seq(2, [7, 8], [4], num_cached_tokens=1)]


def test_fill_copies_rows_and_pads_the_rest():
    buffers = DecodeGraphBuffers(max_batch_size=8, max_blocks_per_seq=4, block_size=4, device=CPU)
    step = build_decode(_decode_seqs(), 4)
    buffers.fill(step, 4)
    ids, positions, meta = buffers.views(4)
    assert ids.tolist() == [14, 28, 8, 0]
    assert positions.tolist() == [4, 8, 1, 0]
    assert meta.slot_mapping.tolist() == [8, 12, 17, PAD_SLOT]
    assert meta.context_lens.tolist() == [5, 9, 2, PAD_CONTEXT_LEN]
    assert meta.block_tables[:, :3].tolist() == [[6, 2, 0], [1, 5, 3], [4, 0, 0], [0, 0, 0]]
    assert meta.block_tables.shape == (4, 4) and meta.max_seqlen_k == 16 and not meta.is_prefill
    assert meta.context_lens.dtype == torch.int32 and meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous()


def test_a_smaller_batch_overwrites_stale_rows_with_padding():
    buffers = DecodeGraphBuffers(8, 4, 4, CPU)
    buffers.fill(build_decode(_decode_seqs(), 4), 4)
    buffers.fill(build_decode(_decode_seqs()[2:], 4), 2)
    ids, _, meta = buffers.views(2)
    assert ids.tolist() == [8, 0]
    assert meta.slot_mapping.tolist() == [17, PAD_SLOT]
    assert meta.context_lens.tolist() == [2, PAD_CONTEXT_LEN]
    assert meta.block_tables[:, 0].tolist() == [4, 0]


def test_fill_refuses_what_does_not_fit():
    buffers = DecodeGraphBuffers(2, 2, 4, CPU)
    with pytest.raises(ValueError):
        buffers.fill(build_decode(_decode_seqs(), 4), 2)  # 3 rows into 2
    with pytest.raises(ValueError):
        buffers.fill(build_decode(_decode_seqs()[1:2], 4), 2)  # 3 blocks into 2 columns
    with pytest.raises(ValueError):
        buffers.fill(build_prefill(_decode_seqs()[:1], 4), 2)


class _EagerGraph:
    """Stands in for a captured CUDA graph: replay runs the forward on the static buffers."""

    def __init__(self, graphs: DecodeGraphs, batch_size: int):
        self.graphs, self.batch_size = graphs, batch_size

    def replay(self) -> None:
        out = self.graphs.forward(*self.graphs.buffers.views(self.batch_size))
        self.graphs.outputs[self.batch_size].copy_(out)


def test_padded_decode_through_the_buffers_equals_eager_and_padding_stores_nothing():
    from services.engine.layers.attention_backends.triton import TritonBackend
    from services.engine.kernels.paged_tile import interpreting
    from tests.gpu_path.tiny_model import TINY_CONFIG, tiny_llama

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    model = tiny_llama(TritonBackend())
    layers = model.attention_layers()
    cache = allocate_kv_cache(2, 8, 4, 2, 8, torch.float32, CPU)
    cache.normal_(generator=torch.Generator().manual_seed(1))
    bind_kv_cache(layers, cache)
    step = build_decode(_decode_seqs(), 4)
    before = cache.clone()
    with torch.inference_mode():
        inputs = to_model_inputs(step, CPU)
        eager = model(inputs.input_ids, inputs.positions, inputs.meta)  # [3, hidden]
        after_eager = cache.clone()
        cache.copy_(before)
        graphs = DecodeGraphs(model, DecodeGraphBuffers(8, 4, 4, CPU), [1, 2, 4, 8])
        for size in graphs.sizes:
            graphs.graphs[size] = _EagerGraph(graphs, size)
            graphs.outputs[size] = torch.empty(size, TINY_CONFIG.hidden_size)
        replayed = graphs.run(step)
    assert replayed.shape == (3, TINY_CONFIG.hidden_size) and replayed.isfinite().all()
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    # The real rows' K/V may differ from eager in the last bits (a batch of 4, not 3, in the projections' matmul).
    written = torch.zeros(cache.shape[2:4], dtype=torch.bool)  # [num_blocks, block_size]
    for slot in step.slot_mapping:
        written[slot // 4, slot % 4] = True
    torch.testing.assert_close(cache[:, :, written], after_eager[:, :, written], rtol=1e-5, atol=1e-5)
    assert torch.equal(cache[:, :, ~written], before[:, :, ~written]), "padded rows must not write the KV cache"
    assert graphs.outputs[4][3].isfinite().all(), "a padded row's output must stay finite"
    assert graphs.run(build_decode(_decode_seqs() * 3, 4)) is None, "9 rows fit no graph here: eager"
