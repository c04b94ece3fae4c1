"""--engine and --routing: targets to connect to as they are vs names to resolve, and the flag's forms."""

import asyncio

import pytest

from services.tokenizer.serving.main import parse_args
from services.tokenizer.routing import Routing
from services.tokenizer.routing_targets import EngineTarget, parse_targets, resolve_with_getaddrinfo


@pytest.mark.parametrize("value, expected", [
    ("10.0.0.7:50052", EngineTarget("10.0.0.7:50052")),
    ("[::1]:7", EngineTarget("[::1]:7")),
    ("::1", EngineTarget("[::1]:50052")),
    ("engine:50052", EngineTarget("engine", 50052)),
    ("engine", EngineTarget("engine", 50052)),
    ("dns:///llmserve-engine.ns.svc.cluster.local:9", EngineTarget("llmserve-engine.ns.svc.cluster.local", 9)),
    ("dns:///10.1.2.3:9", EngineTarget("10.1.2.3:9")),
    ("unix:/run/engine.sock", EngineTarget("unix:/run/engine.sock")),
])
def test_a_target_is_an_address_or_a_name_to_resolve(value, expected):
    assert parse_targets([value]) == [expected]
    assert expected.resolvable == (expected.port is not None)


@pytest.mark.parametrize("value", ["engine:", "engine:http", "engine:70000", "1:2:3:4", ":50052", " , "])
def test_bad_targets_are_refused(value):
    with pytest.raises(ValueError):
        parse_targets([value])


def test_engine_is_repeatable_and_comma_separated_and_deduplicated():
    args = parse_args(["--engine", "a:1,10.0.0.1:2", "--engine", "a:1", "--engine", "b:3"])
    assert args.engine_targets == [EngineTarget("a", 1), EngineTarget("10.0.0.1:2"), EngineTarget("b", 3)]


def test_defaults_are_one_local_engine_and_prefix_routing():
    args = parse_args([])
    assert args.engine_targets == [EngineTarget("127.0.0.1:50052")] and not args.engine_targets[0].resolvable
    assert args.routing is Routing.PREFIX


@pytest.mark.parametrize("name", ["round-robin", "least-load", "prefix"])
def test_routing_takes_each_policy_by_name(name):
    assert parse_args(["--routing", name]).routing == Routing(name)


@pytest.mark.parametrize("argv", [["--routing", "random"], ["--engine", "engine:http"]])
def test_bad_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_getaddrinfo_resolves_every_address_of_a_name():
    assert asyncio.run(resolve_with_getaddrinfo("127.0.0.1", 5)) == ["127.0.0.1:5"]
