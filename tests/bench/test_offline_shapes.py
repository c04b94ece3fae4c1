"""bench/offline.py's shape matrix: the axes the CPU-speed issue asks for, and workloads inside each shape."""

from bench.offline import SHAPES, Shape, make_workload

SHORT_INPUT, LONG_INPUT, SHORT_OUTPUT, LONG_OUTPUT = 64, 256, 32, 128


def test_the_shapes_span_batch_sizes_and_short_and_long_prompts_and_outputs():
    assert {shape.num_seqs for shape in SHAPES.values()} == {1, 8, 32, 64}
    assert any(shape.max_input <= SHORT_INPUT for shape in SHAPES.values())
    assert any(shape.min_input >= LONG_INPUT for shape in SHAPES.values())
    assert any(shape.max_output <= SHORT_OUTPUT for shape in SHAPES.values())
    assert any(shape.min_output >= LONG_OUTPUT for shape in SHAPES.values())


def test_a_workload_draws_inside_its_shape_and_repeats_with_its_seed():
    shape = Shape(num_seqs=20, min_input=3, max_input=9, min_output=2, max_output=5)
    workload = make_workload(shape, vocab_size=100, seed=7)
    assert len(workload) == 20
    assert all(3 <= len(prompt) <= 9 and 2 <= num_output <= 5 for prompt, num_output in workload)
    assert all(10 <= token < 100 for prompt, _ in workload for token in prompt)
    assert make_workload(shape, vocab_size=100, seed=7) == workload != make_workload(shape, vocab_size=100, seed=8)
