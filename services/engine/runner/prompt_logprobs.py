"""Log-probabilities of the prompt tokens, for the prefill chunks of the requests that ask for them.

A prefill step normally runs the lm_head on each sampled sequence's last position only. For an asking
sequence it also runs it on the chunk's prompt positions: position p predicts prompt token p + 1, so a chunk
[start, end) yields the entries of tokens start + 1 .. end (the last chunk stops at the prompt's last token:
its last position is the sampling row). The values are the model's raw distribution, as for sampled tokens
(runner/logprobs.py): an fp32 log_softmax of the logits, gathered at each next prompt token, and its top-k.

The rows run in slices of at most `max_rows`, so a long prompt chunk never holds more than a [max_rows, V]
fp32 tensor at once (the memory profile reserves that much for max_num_seqs sampled rows). Every
tensor-parallel rank runs the same slices (the lm_head all-gathers); only rank 0 reads the results.
Sequences that do not ask add nothing to the step.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.core.interfaces import PromptLogprobs
from services.engine.core.sequence import Sequence


@dataclass(slots=True)
class PromptRows:
    """The prompt positions of one prefill step whose next-token log-probabilities were asked for.

    indices [2, M] int64 (host): row of the step's flat hidden output [N, hidden], then the prompt token that
    position predicts. The rows of asking sequence i are consecutive: the next `num_rows[i]` of them.
    """

    indices: torch.Tensor
    seq_ids: list[int]  # [A]
    num_rows: list[int]  # [A]
    num_top: list[int]  # [A], alternatives each asked for

    def detached(self) -> "PromptRows":
        return PromptRows(self.indices.clone(), self.seq_ids, self.num_rows, self.num_top)


def make_prompt_rows(seqs: list[Sequence], starts: np.ndarray, ends: np.ndarray,
                     cu_q: np.ndarray) -> PromptRows | None:
    """The asking rows of a prefill of `seqs`, each computing token_ids[starts[b]:ends[b]] from flat row
    cu_q[b] - (ends[b] - starts[b]); None when no sequence asks (the usual case: one attribute test each)."""
    asking = [b for b, seq in enumerate(seqs)
              if seq.sampling.num_prompt_logprobs is not None and seq.needs_prompt_logprobs]
    if not asking:
        return None
    rows, targets, seq_ids, num_rows, num_top = [], [], [], [], []
    for b in asking:
        seq, start = seqs[b], int(starts[b])
        stop = min(int(ends[b]), seq.num_prompt_tokens - 1)  # positions start .. stop - 1 predict a prompt token
        if stop <= start:
            continue  # a one-token prompt, or a last chunk of the last token only
        first_row = int(cu_q[b]) - (int(ends[b]) - start)
        rows.append(np.arange(first_row, first_row + stop - start))
        targets.append(seq.token_ids[start + 1:stop + 1])
        seq_ids.append(seq.seq_id)
        num_rows.append(stop - start)
        num_top.append(seq.sampling.num_prompt_logprobs)
    if not seq_ids:
        return None
    indices = torch.from_numpy(np.stack([np.concatenate(rows), np.concatenate(targets)]).astype(np.int64))
    return PromptRows(indices, seq_ids, num_rows, num_top)


@dataclass(slots=True)
class DevicePromptLogprobs:
    """A step's prompt log-probabilities, still on the device (nothing here has waited on it)."""

    rows: PromptRows
    logprobs: torch.Tensor  # float32 [M]
    top_values: torch.Tensor  # float32 [M, K]
    top_ids: torch.Tensor  # int64 [M, K]

    def to_host(self) -> dict[int, PromptLogprobs]:
        """seq_id -> the PromptLogprobs chunk of this step, each row cut to the alternatives it asked for."""
        rows = self.rows
        logprobs = self.logprobs.cpu()
        top_values, top_ids = self.top_values.cpu(), self.top_ids.cpu()
        targets = rows.indices[1]
        result, start = {}, 0
        for seq_id, count, k in zip(rows.seq_ids, rows.num_rows, rows.num_top):
            end = start + count
            result[seq_id] = PromptLogprobs(k, targets[start:end].tolist(), logprobs[start:end].tolist(),
                                            top_ids[start:end, :k].reshape(-1).tolist(),
                                            top_values[start:end, :k].reshape(-1).tolist())
            start = end
        return result


def compute_prompt_logprobs(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            rows: PromptRows, max_rows: int) -> DevicePromptLogprobs:
    """Run `lm_head` on the asking rows of `hidden` [N, hidden], `max_rows` at a time, and keep each row's
    prompt token logprob and top max(num_top) alternatives."""
    indices = rows.indices.to(hidden.device, non_blocking=True)  # [2, M]
    selected = hidden.index_select(0, indices[0])  # [M, hidden]
    max_top = max(rows.num_top)
    logprobs, top_values, top_ids = [], [], []
    for start in range(0, selected.shape[0], max_rows):
        part = lm_head(selected[start:start + max_rows]).float().log_softmax(dim=-1)  # [m, V]
        logprobs.append(part.gather(1, indices[1, start:start + max_rows, None]).squeeze(1))  # [m]
        values, ids = part.topk(max_top, dim=-1)  # [m, K]
        top_values.append(values)
        top_ids.append(ids)
        del part
    return DevicePromptLogprobs(rows, torch.cat(logprobs), torch.cat(top_values), torch.cat(top_ids))
