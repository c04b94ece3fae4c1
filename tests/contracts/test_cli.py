"""The `llmserve` CLI, run as `python -m llmserve.cli` in a subprocess against the fake service."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest

from llmserve.textgen.v1 import textgen_pb2
from tests.contracts import fake_textgen
from tests.contracts.conftest import REPO_ROOT

READ_TIMEOUT_S = 30.0


def cli_env() -> dict[str, str]:
    """The test's environment, with the client importable and Python's own stdout buffering left on."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONUNBUFFERED", "LLMSERVE_TARGET")}
    client_path = str(REPO_ROOT / "clients" / "python")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [client_path, env.get("PYTHONPATH")]))
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args],
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def read_until(stream, wanted: bytes) -> bytes:
    """Read a pipe until `wanted` has appeared, failing after READ_TIMEOUT_S without it."""
    seen = b""
    fd = stream.fileno()
    while wanted not in seen:
        ready, _, _ = select.select([fd], [], [], READ_TIMEOUT_S)
        assert ready, f"nothing more after {seen!r} within {READ_TIMEOUT_S}s"
        chunk = os.read(fd, 4096)
        assert chunk, f"stream closed after {seen!r}"
        seen += chunk
    return seen


def test_generate_prints_each_delta_as_it_arrives(fake_server):
    gate = fake_server.servicer.add_gate("gate-cli")
    prompt = "naïve streaming works"
    pieces = fake_textgen.fake_reply(textgen_pb2.GenerateRequest(text=prompt)).pieces
    args = ["generate", prompt, "--target", fake_server.target, "--request-id", "gate-cli", "--timeout", "60"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", *args],
        cwd=REPO_ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        first = read_until(proc.stdout, pieces[0].encode())
        assert proc.poll() is None and not gate.is_set()  # printed while the server still holds the rest
        gate.set()
        rest, err = proc.communicate(timeout=60)
    finally:
        gate.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert (first + rest).decode("utf-8") == "".join(pieces) + "\n"


def test_generate_json_prints_the_final_result(fake_server):
    proc = run_cli(
        "generate", "a b c d", "--max-tokens", "2", "--temperature", "0", "--json", "--target", fake_server.target
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    want = fake_textgen.fake_reply(textgen_pb2.GenerateRequest(text="a b c d", sampling={"max_tokens": 2}))
    assert result["finish_reason"] == "length"
    assert result["token_ids"] == want.token_ids
    assert result["text"] == "".join(want.pieces)
    request = fake_server.servicer.requests[-1]
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0


def test_logprobs_and_penalty_flags_reach_the_request_and_the_json(fake_server):
    proc = run_cli("generate", "a b", "--logprobs", "2", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
                   "--frequency-penalty", "-0.25", "--json", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    sampling = fake_server.servicer.requests[-1].sampling
    assert (sampling.num_logprobs, sampling.repetition_penalty, sampling.presence_penalty,
            sampling.frequency_penalty) == (2, pytest.approx(1.2), 0.5, -0.25)
    logprobs = json.loads(proc.stdout)["logprobs"]
    assert len(logprobs) == 3  # "b", "a", EOS
    assert logprobs[0]["sampled"] == {"token_id": 100, "text": "b ", "logprob": -0.5}
    assert [entry["text"] for entry in logprobs[0]["top"]] == ["t0", "t1"]


def test_streamed_logprobs_go_to_stderr_after_the_text(fake_server):
    proc = run_cli("generate", "a b", "--logprobs", "1", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "b a \n"  # the fake answers with the words reversed
    lines = proc.stderr.splitlines()
    assert len(lines) == 3 and lines[0].split()[:2] == ["-0.5000", "'b"] and "'t0' -0.500" in lines[0]


def test_without_logprobs_the_json_has_none(fake_server):
    proc = run_cli("generate", "a b", "--json", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    assert "logprobs" not in json.loads(proc.stdout)
    assert not fake_server.servicer.requests[-1].sampling.HasField("num_logprobs")


def test_chat_and_system_flags_send_chat_messages(fake_server):
    proc = run_cli(
        "generate", "hello there", "--system", "be brief", "--stop", "x", "--stop", "y", "--target", fake_server.target
    )
    assert proc.returncode == 0, proc.stderr
    request = fake_server.servicer.requests[-1]
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "be brief"), ("user", "hello there")]
    assert list(request.stop) == ["x", "y"]
    assert proc.stdout == "there hello \n"


def test_invalid_argument_shows_code_and_field_without_traceback(fake_server):
    proc = run_cli("generate", "", "--target", fake_server.target)
    field, description = fake_textgen.EMPTY_PROMPT_VIOLATION
    assert proc.returncode == 1
    assert "INVALID_ARGUMENT" in proc.stderr and f"{field}: {description}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_unreachable_server_is_unavailable(fake_server):
    proc = run_cli("info", "--target", "127.0.0.1:1", "--timeout", "10")
    assert proc.returncode == 1
    assert "UNAVAILABLE" in proc.stderr and "Traceback" not in proc.stderr


def test_health_exit_code_follows_the_serving_status(fake_server):
    serving = run_cli("health", "--target", fake_server.target)
    draining = run_cli("health", "--service", fake_textgen.DRAINING_SERVICE, "--target", fake_server.target)
    assert (serving.returncode, serving.stdout.strip()) == (0, "SERVING")
    assert (draining.returncode, draining.stdout.strip()) == (1, "NOT_SERVING")


def test_tokenize_prints_token_ids(fake_server):
    proc = run_cli("tokenize", "ab", "--no-add-special-tokens", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(ord("a")), str(ord("b"))]


def test_target_comes_from_the_environment(fake_server):
    env = cli_env() | {"LLMSERVE_TARGET": fake_server.target}
    proc = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "info", "--json"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model_name"] == "fake-model"


def test_generate_n_prints_each_completion_on_its_own_line(fake_server):
    proc = run_cli("generate", "a b", "--n", "3", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[0] b#0 a#0 ", "[1] b#1 a#1 ", "[2] b#2 a#2 "]
    assert fake_server.servicer.requests[-1].sampling.n == 3


def test_generate_n_json_lists_the_completions(fake_server):
    proc = run_cli("generate", "a b", "--n", "2", "--json", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    completions = json.loads(proc.stdout)["completions"]
    assert [(c["index"], c["text"]) for c in completions] == [(0, "b#0 a#0 "), (1, "b#1 a#1 ")]


def test_prompt_logprobs_flag_reaches_the_request_and_prints_before_the_completions(fake_server):
    proc = run_cli("generate", "a b c", "--prompt-logprobs", "2", "--logprobs", "0", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    assert fake_server.servicer.requests[-1].sampling.num_prompt_logprobs == 2
    lines = proc.stderr.splitlines()
    assert lines[0] == "prompt:" and lines[1].split() == ["-", "(no", "context)"]  # "a": nothing predicts it
    assert lines[2].split()[:2] == ["-1.5000", "'b'"] and "'t1' -1.500" in lines[2]
    assert lines[4] == "completion:" and len(lines) == 5 + 4  # "c", "b", "a", EOS
    proc = run_cli("generate", "a b c", "--prompt-logprobs", "0", "--json", "--target", fake_server.target)
    prompt_logprobs = json.loads(proc.stdout)["prompt_logprobs"]
    assert prompt_logprobs[0] == {"sampled": None, "top": []}
    assert prompt_logprobs[2] == {"sampled": {"token_id": 202, "text": "c", "logprob": -1.5}, "top": []}
    assert "logprobs" not in json.loads(proc.stdout)
