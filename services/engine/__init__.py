"""The llmserve engine: paged-KV continuous batching.

`LLM` and `SamplingParams` are exported lazily so that importing `services.engine.core`
(which must stay free of torch) does not pull in the model runner.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from services.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from services.engine.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
