"""Where a model's sampling defaults come from: its generation config, else its model card (the embedded model
only), else neutral values."""

import json

from services.common.generation_defaults import NEUTRAL_SAMPLING, read_generation_config, sampling_defaults

EMBEDDED = "SmolLM2-135M-Instruct"


def test_the_embedded_model_without_a_config_takes_its_cards_low_temperature():
    assert sampling_defaults(EMBEDDED, None) == NEUTRAL_SAMPLING | {"temperature": 0.2, "top_p": 0.9}


def test_another_model_without_a_config_is_neutral():
    assert sampling_defaults("SmolLM2-360M-Instruct", None) == NEUTRAL_SAMPLING
    assert sampling_defaults("my-model", {}) == NEUTRAL_SAMPLING


def test_the_generation_config_wins_over_the_card_key_by_key():
    config = {"temperature": 0.7, "top_k": 20, "top_p": None, "repetition_penalty": 1.05, "do_sample": False}
    assert sampling_defaults(EMBEDDED, config) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}


def test_read_generation_config(tmp_path):
    assert read_generation_config(str(tmp_path)) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert read_generation_config(str(tmp_path)) == {"temperature": 0.6}
