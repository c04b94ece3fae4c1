"""Which rows of a prefill step get prompt logprobs, and which prompt token each predicts (block size 4)."""

from services.engine.core.sampling_params import SamplingParams
from services.engine.runner.inputs import build_prefill
from tests.runner.helpers import make_seq

ASKING = SamplingParams(temperature=0.0, num_prompt_logprobs=2)


def test_only_the_asking_sequences_chunks_get_rows_each_predicting_the_next_prompt_token():
    plain = make_seq(0, list(range(100, 106)), [1, 2])  # 6 new rows, asks nothing
    first_chunk = make_seq(1, list(range(200, 210)), [3, 4, 5], num_scheduled_tokens=4, sampling=ASKING)
    last_chunk = make_seq(2, list(range(300, 310)), [6, 7, 8], num_cached_tokens=4, sampling=ASKING)
    rows = build_prefill([plain, first_chunk, last_chunk], 4).prompt_rows
    assert rows.seq_ids == [1, 2] and rows.num_rows == [4, 5] and rows.num_top == [2, 2]
    # first chunk: positions 0..3 (rows 6..9) predict tokens 1..4 (the last one opens the next chunk)
    # last chunk: positions 4..8 (rows 10..14) predict tokens 5..9; position 9 (row 15) samples instead
    assert rows.indices[0].tolist() == [6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert rows.indices[1].tolist() == [201, 202, 203, 204, 305, 306, 307, 308, 309]


def test_no_rows_without_an_asking_sequence_or_once_past_the_prompt():
    assert build_prefill([make_seq(0, [1, 2, 3], [1])], 4).prompt_rows is None
    one_token = make_seq(0, [9], [1], sampling=ASKING)
    assert build_prefill([one_token], 4).prompt_rows is None
    recomputed = make_seq(1, [1, 2, 3, 4, 5], [2, 3], sampling=ASKING, num_prompt_tokens=3)  # preempted
    assert build_prefill([recomputed], 4).prompt_rows is None
    sibling = make_seq(2, [1, 2, 3], [4], sampling=ASKING)
    sibling.index = 1  # completion 1 of n: completion 0 computes the prompt's
    assert build_prefill([sibling], 4).prompt_rows is None
