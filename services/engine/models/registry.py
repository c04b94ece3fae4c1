"""Architecture name -> model class."""

from torch import nn

from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

# Hugging Face `architectures` entries -> our registry keys
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_CLASSES))}") from None
