"""The competitor: Hugging Face transformers on the same weights (the embedded GGUF or an HF directory)."""

import os

from services.common.default_model import default_model_path


def default_gguf() -> tuple[str, str]:
    """(directory, file name) of the embedded SmolLM2 GGUF."""
    path = default_model_path()
    return os.path.dirname(path), os.path.basename(path)


def load_hf_model(model_path: str | None, device: str = "cpu"):
    """transformers' own model in fp32 (eval mode) and its pad id."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_path is None:
        directory, name = default_gguf()
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    elif model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path) or ".",
                                                     gguf_file=os.path.basename(model_path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    model = model.to(device).eval()
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    return model, pad_id
