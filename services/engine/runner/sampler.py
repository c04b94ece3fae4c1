"""Vectorized token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Filter boundaries (pinned by tests/runner/test_sampler.py): top-k keeps ranks < k; top-p keeps a token while
the probability mass ranked strictly above it is < top_p, so the kept head is the smallest whose mass
reaches top_p; min-p keeps tokens with probability >= min_p * the top probability.

Top-p ranks tokens by sorting the vocabulary, except on CPU, where it first takes each row's TOP_P_CANDIDATES
most likely tokens (a top-k: 3-8x cheaper than the sort at V=49152) and sorts in full only the rows whose
survivors do not all lie among them (bench/top_p.py; the same survivors, pinned by test_top_p_candidates.py).

`Sampler.sample` never waits on the device; `__call__` adds the step's one host sync (`.tolist()`).
An all-greedy batch builds no parameter tensors at all, and a batch without greedy rows skips the argmax.

Drawing: inverse-CDF sampling, one uniform u in [0, 1) per row (O(B) random numbers a step, where the
exponential race this replaced drew B x V). The row's token is the first whose cumulative probability exceeds
u * total. Unseeded rows take u from the sampler's generator; seeded rows take the u that SamplingBatch
hashed on the host from (seed, sample index) alone (sampling_batch.seeded_uniforms), so a seeded row draws the
same token whatever else shares the batch, without a generator per row.

NOTE: a zero-probability token is never drawn. The search finds j with cdf[j-1] <= t < cdf[j] (t = u * total,
kept strictly below total so j < V), so token j has a step in the cdf. On CPU the scan is sequential (float64
accumulator), so a zero adds exactly nothing and has no step. A parallel scan (CUDA) adds in tree order, and
two neighbours' prefixes may then differ by an ulp across a zero; there the zeros' cdf entries are replaced
by the running maximum of the nonzero ones (`exact_zero_steps=False`), which leaves them no step either.
The fp32 cdf resolves about 6e-8 of probability near its top, about what the exponential race in fp32 did.
"""

import torch

from services.engine.runner.sampling_batch import SamplingBatch

# On CPU, top-p looks at each row's this many most likely tokens before sorting the whole vocabulary
# (_mask_among_candidates): enough for the mass that any usual top_p keeps at usual temperatures.
TOP_P_CANDIDATES = 1024


class Sampler:
    """Turns logits [B, V] into one token id per row. Unseeded rows share `generator`."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
        return self.sample(logits, batch).tolist()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids [B] on the logits' device, without waiting on it."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)  # [B]
        probs = self.filtered_probs(logits.float(), batch)  # [B, V]
        sampled_ids = sample_inverse_cdf(probs, self._uniforms(batch),
                                         exact_zero_steps=probs.device.type == "cpu")  # [B]
        if batch.is_greedy is None:
            return sampled_ids
        return torch.where(batch.is_greedy, logits.argmax(dim=-1), sampled_ids)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Probabilities after temperature, then top-k, top-p (over the top-k survivors) and min-p."""
        logits = logits / batch.temperatures[:, None]
        if batch.use_top_k or batch.use_top_p:
            logits = _mask_top_k_top_p(logits, batch)
        probs = logits.softmax(dim=-1)  # [B, V]
        if batch.use_min_p:
            threshold = batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _uniforms(self, batch: SamplingBatch) -> torch.Tensor:
        """One uniform in [0, 1) per row [B] float64: the seeded rows' own, the others' from `generator`."""
        num_rows = batch.temperatures.shape[0]
        uniforms = torch.rand(num_rows, generator=self.generator, dtype=torch.float64, device=self.device)
        if batch.is_seeded is None:
            return uniforms
        return torch.where(batch.is_seeded, batch.seeded_uniforms, uniforms)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, exact_zero_steps: bool) -> torch.Tensor:
    """Token ids [B]: row b's first token whose cumulative probability exceeds uniforms[b] * its total.

    probs [B, V] fp32 >= 0 (need not sum to 1; each row has a positive entry); uniforms [B] float64 in [0, 1).
    `exact_zero_steps`: whether probs.cumsum adds a zero exactly (true of CPU's sequential scan); when false,
    the zeros' cdf entries are rebuilt so they cannot be drawn (see the module docstring).
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    if not exact_zero_steps:
        cdf = torch.where(probs > 0, cdf, 0.0).cummax(dim=-1).values
    total = cdf[:, -1:]  # [B, 1]
    targets = (uniforms[:, None] * total.double()).float()  # [B, 1]
    # Rounding to fp32 can carry u * total up to total itself; the largest float below it keeps j < V.
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1)


def _mask_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.use_top_p and logits.device.type == "cpu" and logits.shape[-1] > TOP_P_CANDIDATES:
        return _mask_among_candidates(logits, batch)
    return _mask_by_full_sort(logits, batch.top_ks, batch.top_ps if batch.use_top_p else None)


def _mask_by_full_sort(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks[:, None], float("-inf"))
    if top_ps is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # A token survives while the mass ranked above it is below top_p; the top token always does.
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_ps[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _mask_among_candidates(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """_mask_by_full_sort's result from each row's TOP_P_CANDIDATES most likely tokens (a top-k, not a sort of
    the vocabulary: 8-14x less work on CPU), for every row whose survivors all lie among them: its top_k is at
    most that many, or the mass ranked above its last candidate already reaches its top_p (top_k off). Other
    rows are sorted in full; a row without either filter is kept whole. Which way a row goes depends on that
    row alone, so its result does not depend on the rest of the batch. CPU only: choosing needs a host sync.
    """
    num_candidates = TOP_P_CANDIDATES
    vocab_size = logits.shape[-1]
    top_logits, top_ids = logits.topk(num_candidates, dim=-1)  # [B, C], descending
    ranks = torch.arange(num_candidates)[None, :]
    small_k = batch.top_ks <= num_candidates  # [B]
    top_logits = top_logits.masked_fill(ranks >= batch.top_ks[:, None], float("-inf"))
    # softmax denominators over what top-k keeps: the candidates (top_k <= C) or the whole vocabulary (top_k off)
    log_total = torch.where(small_k, top_logits.logsumexp(dim=-1), logits.logsumexp(dim=-1))  # [B]
    probs = (top_logits - log_total[:, None]).exp()  # [B, C]
    mass_before = probs.cumsum(dim=-1) - probs
    top_logits = top_logits.masked_fill(mass_before >= batch.top_ps[:, None], float("-inf"))
    masked = torch.full_like(logits, float("-inf")).scatter_(-1, top_ids, top_logits)
    unfiltered = (batch.top_ks >= vocab_size) & batch.top_ps.isinf()  # [B]
    covered = small_k | ((batch.top_ks >= vocab_size) & (mass_before[:, -1] >= batch.top_ps)) | unfiltered
    if not bool(covered.all()):
        rows = (~covered).nonzero().flatten()
        masked[rows] = _mask_by_full_sort(logits[rows], batch.top_ks[rows], batch.top_ps[rows])
    return torch.where(unfiltered[:, None], logits, masked)
