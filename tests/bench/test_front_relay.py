"""bench/front_relay.py relays every token of every request through the real front classes and reports each phase."""

from bench import front_relay


def test_each_stream_count_gets_a_row_of_phases_and_every_request_finishes(capsys):
    costs = front_relay.main(["--streams", "1,5", "--steps", "3", "--repeats", "1"])  # raises if a request is left open
    assert [cost.num_streams for cost in costs] == [1, 5]
    assert all(set(cost.per_token_us) == set(front_relay.PHASES) for cost in costs)
    out = capsys.readouterr().out
    assert "engine front relay, CPU µs per token (3 tokens per request" in out
    assert len(out.strip().splitlines()) == 2 + 2  # title, header, a row per stream count


def test_the_step_messages_finish_every_stream_on_the_last_step_only():
    from services.engine.serving.messages import decode

    steps = [decode(message) for message in front_relay.step_messages(4, 3)]
    assert [list(step.handles) for step in steps] == [[0, 1, 2, 3]] * 3
    assert [len(step.finished) for step in steps] == [0, 0, 4]
    assert [step.token_ids[0] for step in steps] == [1000, 1001, 1002]


def test_the_batch_builds_one_response_per_stream_per_step(monkeypatch):
    num_streams, built = 3, []
    real = front_relay.batch_responses
    monkeypatch.setattr(front_relay, "batch_responses", lambda outputs: built.append(len(outputs.outputs)) or real(outputs))
    front_relay.measure(num_streams, 2, 1)
    assert built == [num_streams, num_streams]
