"""Structured output, compile side: a request's constraint compiled with xgrammar against this model's vocabulary.

Compiling is done at admission (EngineCore.add_request -> ModelRunner.compile_grammar), once per distinct
(kind, text): an LRU of compiled grammars serves every later request with the same constraint, and a compile
error becomes INVALID_ARGUMENT naming the field before the request is queued. xgrammar and the tokenizer's
token table (TokenizerInfo: ~0.3 s for SmolLM2's 49k tokens) load on the first constrained request, so an
engine that never sees one never pays for them.
"""

import logging
import re
from collections import OrderedDict

from services.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 64
# Whitespace between JSON tokens is capped, so a model that keeps emitting blanks cannot run a JSON completion
# to max_tokens: pretty-printed JSON ("\n" plus indentation) still fits.
MAX_JSON_WHITESPACE = 16
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's C++ errors read "[15:40:25] /project/cpp/regex_converter.cc:83: Regex parsing error at ...".
_CPP_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


class GrammarCompiler:
    """Compiles (kind, text) constraints (SamplingParams.constraint) into xgrammar CompiledGrammars.

    `tokenizer`: the checkpoint's Hugging Face tokenizer (None: constrained requests are refused).
    `vocab_size`: the model's logits width, which is the mask's width. `stop_token_ids`: the engine's EOS ids,
    the only tokens a grammar allows once it is complete (the scheduler then finishes the request with STOP).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = DEFAULT_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._compiler = None
        self.num_compiled = 0  # compilations done (cache misses), for tests and logs

    def compile(self, constraint: tuple[str, str]):
        """The xgrammar.CompiledGrammar of `constraint`, from the cache when it was compiled before.

        Raises InvalidRequestError("sampling.<kind>") when the text does not compile or the model has no tokenizer.
        """
        compiled = self._cache.get(constraint)
        if compiled is not None:
            self._cache.move_to_end(constraint)
            return compiled
        kind, text = constraint
        compiled = self._compile_uncached(kind, text)
        self.num_compiled += 1
        self._cache[constraint] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, kind: str, text: str):
        compiler = self._xgrammar_compiler(kind)
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "grammar":
                return compiler.compile_grammar(text)
            if kind == "json_object":  # any JSON object, as OpenAI's response_format json_object
                return compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, strict_mode=False,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError subclasses
            raise InvalidRequestError(f"sampling.{kind}", f"does not compile: {_clean_error(exc)}") from None
        raise InvalidRequestError(f"sampling.{kind}", "is not a known constraint kind")

    def _xgrammar_compiler(self, kind: str):
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"sampling.{kind}", "this model has no tokenizer, so its output cannot "
                                                              "be constrained")
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids)
            # Our own LRU caches compiled grammars; xgrammar's cache would only hold a second copy.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            logger.info("structured output ready: %d-token vocabulary, stop tokens %s", self.vocab_size,
                        self.stop_token_ids)
        return self._compiler


def _clean_error(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    message = _CPP_PREFIX.sub("", lines[0] if lines else type(exc).__name__)
    return _CPP_PREFIX.sub("", message).strip() or type(exc).__name__
