"""Checkpoint loading: `load_model_config(path)` and `load_weights(model, path)` for GGUF files and
Hugging Face safetensors directories."""

import functools
import os

from torch import nn

from services.engine.models.config import ModelConfig


def gguf_file_of(path: str) -> str | None:
    """The GGUF file a model path names (the file itself, or the only .gguf in a directory), else None."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(files) == 1:
            return os.path.join(path, files[0])
    return None


@functools.lru_cache(maxsize=1)
def open_gguf(path: str):
    """A GGUFReader (memory-mapped; parsing the metadata takes seconds, so the last one is kept)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def load_model_config(path: str) -> ModelConfig:
    """Architecture facts of the checkpoint at `path` (a .gguf file or a Hugging Face directory)."""
    gguf_path = gguf_file_of(path)
    if gguf_path is not None:
        from services.engine.loader.gguf import load_gguf_config

        return load_gguf_config(open_gguf(gguf_path))
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a directory with config.json")
    from services.engine.loader.safetensors import load_hf_config

    return load_hf_config(path)


def load_weights(model: nn.Module, path: str) -> None:
    """Fill `model` (built from load_model_config(path)) with the checkpoint's weights."""
    gguf_path = gguf_file_of(path)
    if gguf_path is not None:
        from services.engine.loader.gguf import iter_gguf_weights

        model.load_weights(iter_gguf_weights(open_gguf(gguf_path), model.config))
        return
    from services.engine.loader.safetensors import iter_safetensors_weights

    model.load_weights(iter_safetensors_weights(path))
