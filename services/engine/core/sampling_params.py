"""Per-request sampling and stopping parameters (plain data, validated at construction)."""

from dataclasses import dataclass, field

from services.common.validation import check_constraint, check_extras, check_sampling

# Temperatures below this sample greedily (dividing the logits by them would overflow).
MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature below MIN_TEMPERATURE (0 included) means greedy. top_k 0 or -1 disables top-k; top_p 1.0
    and min_p 0.0 disable theirs. A `seed` makes this request's draws reproducible whatever else shares the
    batch. The engine stops on EOS (unless `ignore_eos`) or any of `stop_token_ids`, but not before
    `min_tokens` completion tokens, and always at `max_tokens`.
    `num_logprobs` (None = off) asks for the sampled token's log-probability and that many top alternatives per
    generated position, before temperature and filters (raw); `num_prompt_logprobs` (None = off) the same for every
    prompt token after the first, sent once with the first generated token (a request asking for them takes no
    prefix-cache hits: every prompt position's logits are computed). Penalties (off at their neutral values):
    `repetition_penalty` divides positive logits / multiplies negative ones of every token already in the prompt
    or output (transformers' definition); `presence_penalty` and `frequency_penalty` subtract
    presence * [count > 0] + frequency * count over the output tokens (OpenAI's definition).
    `n` completions share the prompt's KV blocks; completion i samples as n=1 with seed + i would.
    `best_of` (None = n) > n generates best_of such completions and keeps the n with the highest cumulative raw
    logprob of their sampled tokens, best first; the engine holds them back until all have finished
    (services.engine.core.best_of).
    Invalid values raise InvalidRequestError with the contract's field name ("sampling.top_p").

    Structured output: at most one of `json_schema` (JSON text), `regex`, `grammar` (EBNF) or `json_object`
    constrains every token so the completion matches it (see common.proto); `constraint` is that choice as
    (kind, text), or None, set at construction. Whether the text compiles is decided at admission.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    num_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    n: int = 1
    best_of: int | None = None
    num_prompt_logprobs: int | None = None
    constraint: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_ranges()
        self.constraint = self._check_constraint()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field out of range; changes nothing.

        Stop token ids are checked against the vocabulary by the engine, which knows its size.
        """
        self._check_ranges()
        self._check_constraint()

    def _check_ranges(self) -> None:
        check_sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                       max_tokens=self.max_tokens, min_tokens=self.min_tokens, seed=self.seed, n=self.n,
                       best_of=self.best_of)
        check_extras(num_logprobs=self.num_logprobs, repetition_penalty=self.repetition_penalty,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     num_prompt_logprobs=self.num_prompt_logprobs)

    def _check_constraint(self) -> tuple[str, str] | None:
        return check_constraint(json_schema=self.json_schema, regex=self.regex, grammar=self.grammar,
                                json_object=self.json_object, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens)

    @property
    def num_generated(self) -> int:
        """How many completions the engine generates: best_of when set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        """Whether the sampler takes the argmax for this request."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits of this request."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
