"""Prompt log-probabilities across a prompt's prefill chunks: gathered on the sequence, sent once.

The runner reports, per prefill step, the entries of the prompt tokens that step's chunk predicted (the last
position of a chunk predicts the first token of the next one). They accumulate on the sequence, which the
scheduler frees with everything else on abort, and leave with its first generated token. A sequence
recomputed after a preemption already has that token, so it neither computes nor sends them again.
"""

from services.engine.core.interfaces import PromptLogprobs
from services.engine.core.sequence import Sequence


def gather_prompt_logprobs(seqs: list[Sequence], chunks: dict[int, PromptLogprobs]) -> None:
    """Append each sequence's chunk of this step (keyed by seq_id) to what it gathered before."""
    if not chunks:
        return
    for seq in seqs:
        chunk = chunks.get(seq.seq_id)
        if chunk is None:
            continue
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = chunk
        else:
            seq.prompt_logprobs.extend(chunk)


def pop_prompt_logprobs(seq: Sequence) -> PromptLogprobs | None:
    """What goes out with the output of `seq` that carries its first generated token: the prompt's entries
    (empty for a one-token prompt) when its request asked, else None; None on every later output."""
    sampling = seq.sampling
    if sampling.num_prompt_logprobs is None or seq.index != 0 or seq.num_completion_tokens != 1:
        return None
    gathered, seq.prompt_logprobs = seq.prompt_logprobs, None
    return gathered if gathered is not None else PromptLogprobs(sampling.num_prompt_logprobs, [], [], [], [])
