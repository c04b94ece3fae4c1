"""The null-runner benchmark runs end to end on a tiny configuration (no timing is asserted)."""

import torch

from bench.step_host_time import block_manager_creation, build_engine, measure


def test_measure_reports_every_phase_with_all_sequences_decoding():
    result = measure(num_seqs=3, context=20, num_steps=2, warmup=1, device=torch.device("cpu"))
    assert set(result) == {"schedule", "input_prep", "postprocess", "outputs", "events", "total", "wall"}
    assert all(value >= 0 for key, value in result.items() if key != "outputs")
    assert result["events"] == 0.0


def test_measure_with_kv_events_times_taking_them():
    result = measure(num_seqs=3, context=20, num_steps=2, warmup=1, device=torch.device("cpu"), kv_events=True)
    assert result["events"] > 0


def test_null_runner_uses_the_runner_input_builder():
    engine = build_engine(num_seqs=2, context=8, num_steps=4, device=torch.device("cpu"))
    assert type(engine.runner.inputs).__name__ == "StepInputBuilder"
    assert block_manager_creation(100)[0] >= 0
