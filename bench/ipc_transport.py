"""The engine-core <-> front transport: a multiprocessing connection against pyzmq, one step message at a time.

    python bench/ipc_transport.py [--outputs 256] [--messages 5000]

A child process sends `--messages` StepOutputs messages (each with `--outputs` requests' tokens, encoded as
the engine core encodes them) to this process, which decodes each one and walks its arrays as a front
does. Reports CPU µs per message on each side and messages/s, for each transport, and the ratio last.
pyzmq is optional (`pip install pyzmq`); without it only the multiprocessing row is printed.
"""

import argparse
import multiprocessing as mp
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.core.interfaces import EngineStats  # noqa: E402
from services.engine.serving.messages import StepOutputs, decode, encode  # noqa: E402


def step_message(num_outputs: int, step: int) -> StepOutputs:
    handles = array("q", range(num_outputs))
    return StepOutputs(handles, array("q", [step] * num_outputs), array("q", [0] * num_outputs), [],
                       EngineStats(num_outputs, 0, num_outputs, 1000, 1000, 0, 0, 0, step), step)


def send_pipe(connection, num_outputs: int, num_messages: int, cpu: mp.Value) -> None:
    start = time.process_time()
    for step in range(num_messages):
        connection.send_bytes(encode(step_message(num_outputs, step)))
    connection.send_bytes(b"")
    cpu.value = time.process_time() - start


def send_zmq(address: str, num_outputs: int, num_messages: int, cpu: mp.Value) -> None:
    import zmq

    socket = zmq.Context().socket(zmq.PUSH)
    socket.connect(address)
    start = time.process_time()
    for step in range(num_messages):
        socket.send(encode(step_message(num_outputs, step)), copy=False)
    socket.send(b"")
    cpu.value = time.process_time() - start
    socket.close(linger=-1)


def consume(receive) -> int:
    total = 0
    while data := receive():
        message = decode(data)
        for handle, token in zip(message.handles, message.token_ids):
            total += handle + token
    return total


def run_pipe(num_outputs: int, num_messages: int) -> tuple[float, float, float]:
    context = mp.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    cpu = context.Value("d", 0.0)
    child = context.Process(target=send_pipe, args=(sender, num_outputs, num_messages, cpu))
    child.start()
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    consume(receiver.recv_bytes)
    wall, receive_cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    child.join()
    return wall, cpu.value, receive_cpu


def run_zmq(num_outputs: int, num_messages: int) -> tuple[float, float, float] | None:
    try:
        import zmq
    except ImportError:
        return None
    socket = zmq.Context().socket(zmq.PULL)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    context = mp.get_context("spawn")
    cpu = context.Value("d", 0.0)
    child = context.Process(target=send_zmq, args=(f"tcp://127.0.0.1:{port}", num_outputs, num_messages, cpu))
    child.start()
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    consume(lambda: socket.recv(copy=True))
    wall, receive_cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    child.join()
    socket.close()
    return wall, cpu.value, receive_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=int, default=256, help="requests with a token in each step message")
    parser.add_argument("--messages", type=int, default=5000)
    args = parser.parse_args()
    rows = {"multiprocessing": run_pipe(args.outputs, args.messages), "pyzmq": run_zmq(args.outputs, args.messages)}
    print(f"{args.messages} step messages of {args.outputs} outputs each")
    print(f"{'transport':16} {'msgs/s':>10} {'send µs/msg':>12} {'recv µs/msg':>12}")
    for name, row in rows.items():
        if row is None:
            print(f"{name:16} (not installed)")
            continue
        wall, send_cpu, receive_cpu = row
        print(f"{name:16} {args.messages / wall:10.0f} {send_cpu / args.messages * 1e6:12.1f} "
              f"{receive_cpu / args.messages * 1e6:12.1f}")
    if rows["pyzmq"] is not None:
        pipe_cpu = rows["multiprocessing"][1] + rows["multiprocessing"][2]
        zmq_cpu = rows["pyzmq"][1] + rows["pyzmq"][2]
        print(f"CPU per message, multiprocessing / pyzmq: {pipe_cpu / zmq_cpu:.2f}")


if __name__ == "__main__":
    main()
