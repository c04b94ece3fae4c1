"""best_of through the client and the CLI: the option reaches the request's sampling, unset unless given."""

from llmserve._convert import build_generate_request
from tests.contracts.test_cli import run_cli


def test_best_of_option_reaches_the_request():
    assert build_generate_request("hi", None, {"n": 2, "best_of": 5}).sampling.best_of == 5
    assert not build_generate_request("hi", None, {"n": 2}).sampling.HasField("best_of")


def test_cli_best_of_flag_reaches_the_request(fake_server):
    proc = run_cli("generate", "a b", "--n", "2", "--best-of", "4", "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    sampling = fake_server.servicer.requests[-1].sampling
    assert (sampling.n, sampling.best_of) == (2, 4)
    assert proc.stdout.splitlines() == ["[0] b#0 a#0 ", "[1] b#1 a#1 "]
