"""bench/grpc_message_cost.py runs end to end on a small load and times both grpc.aio calling conventions and the
sync server."""

from bench import grpc_message_cost


def test_every_server_kind_streams_every_message_and_gets_a_cost(capsys):
    results = grpc_message_cost.main(["--streams", "3", "--messages", "7", "--repeats", "1"])
    assert set(results) == {"context.write", "yield", "sync"}
    # every message arrived (measure() raises otherwise); so few take too little CPU for the clock's resolution
    assert all(len(values) == 1 and values[0] >= 0 for values in results.values())
    out = capsys.readouterr().out
    assert "yield / context.write (best of each):" in out
    assert "sync server / context.write (best of each):" in out
