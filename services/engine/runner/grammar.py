"""Structured output, step side: each constrained row's token bitmask, applied to the logits before sampling.

Each constrained sequence has an xgrammar GrammarMatcher, kept per Sequence object (weakly: it goes with the
sequence) and advanced only on the sequence's own output tokens: before a row is masked its matcher accepts
the completion tokens it has not yet seen. Its state is therefore a function of the accepted output alone,
which makes it correct across preemption (recompute keeps the output tokens, so the matcher stays as it is)
and chunked prefill (a row is masked only when it is sampled). A step with no constrained row costs one pass
over the rows' sampling params and nothing else.
"""

import logging
import weakref
from dataclasses import dataclass

import torch

from services.engine.core.sequence import Sequence
from services.engine.runner.grammar_compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RowMatcher:
    """A sequence's matcher and how many of its completion tokens the matcher has accepted."""

    matcher: object  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    broken: bool = False  # a token the grammar rejects got in: only EOS is allowed from here on


class GrammarMasks:
    """Masks the logits of constrained rows to the tokens their grammar allows next (EOS once it is complete)."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device):
        self.compiler = compiler
        self.device = device
        self._matchers: weakref.WeakKeyDictionary[Sequence, _RowMatcher] = weakref.WeakKeyDictionary()
        self._host_bitmask: torch.Tensor | None = None  # int32 [rows, ceil(V / 32)], pinned on CUDA

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set the disallowed logits [S, V] of each constrained row to -inf, in place; rows are `seqs`' order."""
        rows = [row for row, seq in enumerate(seqs) if seq.sampling.constraint is not None]
        if not rows:
            return
        import xgrammar

        bitmask = self._bitmask(len(seqs))  # [>= S, W]
        for row in rows:
            state = self._synced_matcher(seqs[row])
            if state.broken:
                self._allow_only_stop_tokens(bitmask, row)
            else:
                state.matcher.fill_next_token_bitmask(bitmask, row)
        if logits.device.type != "cpu":
            bitmask = bitmask[:len(seqs)].to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.compiler.vocab_size, indices=rows)

    def _synced_matcher(self, seq: Sequence) -> _RowMatcher:
        """The sequence's matcher, after it has accepted every completion token it had not seen yet."""
        state = self._matchers.get(seq)
        if state is None:
            import xgrammar

            state = _RowMatcher(xgrammar.GrammarMatcher(self.compiler.compile(seq.sampling.constraint)))
            self._matchers[seq] = state
        start = seq.num_prompt_tokens + state.num_accepted
        for token_id in seq.token_ids[start:]:
            state.num_accepted += 1
            if not state.broken and not state.matcher.accept_token(token_id):
                # NOTE: cannot happen with masked sampling; if it does, end the request rather than the engine.
                logger.error("request %s: grammar rejected token %d after %d tokens; ending it at EOS",
                             seq.request_id, token_id, state.num_accepted - 1)
                state.broken = True
        return state

    def _bitmask(self, num_rows: int) -> torch.Tensor:
        import xgrammar

        if self._host_bitmask is None or self._host_bitmask.shape[0] < num_rows:
            bitmask = xgrammar.allocate_token_bitmask(max(num_rows, 8), self.compiler.vocab_size)
            self._host_bitmask = bitmask.pin_memory() if self.device.type == "cuda" else bitmask
        return self._host_bitmask

    def _allow_only_stop_tokens(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for token_id in self.compiler.stop_token_ids:
            word = int(bitmask[row, token_id // 32]) | 1 << (token_id % 32)
            bitmask[row, token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as an int32
