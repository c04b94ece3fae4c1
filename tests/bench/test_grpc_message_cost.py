"""bench/grpc_message_cost.py runs end to end on a small load and times both calling conventions."""

from bench import grpc_message_cost


def test_both_conventions_stream_every_message_and_get_a_cost(capsys):
    results = grpc_message_cost.main(["--streams", "3", "--messages", "7", "--repeats", "1"])
    assert set(results) == {"context.write", "yield"}
    # every message arrived (measure() raises otherwise); so few take too little CPU for the clock's resolution
    assert all(len(values) == 1 and values[0] >= 0 for values in results.values())
    assert "yield / context.write (best of each):" in capsys.readouterr().out
