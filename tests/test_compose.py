"""docker-compose.yml: valid, wired as ARCHITECTURE.md says, and its commands are ones our entry points accept."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from llmserve import cli as llmserve_cli
from llmserve.engine.v1 import engine_pb2
from llmserve.textgen.v1 import textgen_pb2

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
TEXTGEN_SERVICE = textgen_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name
ENTRY_MODULES = {"engine": "services.engine.serving.main", "tokenizer": "services.tokenizer.__main__"}
PUBLIC_PORT = 50051
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["scripts"]


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and $VAR substitution (unset variables take the default or "")."""
    return _VARIABLE.sub(lambda m: env.get(m[1] or m[3]) or (m[2] or ""), value)


def command_of(service: dict, env: dict[str, str] | None = None) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "exec form, so no shell mangles the arguments"
    return [interpolate(part, env or {}) for part in command]


def parse_command(service: dict, scripts: dict[str, str], env: dict[str, str] | None = None):
    """(entry module, parsed args): the console script's module parses the command's flags."""
    program, *flags = command_of(service, env)
    assert program in scripts, f"{program} is not a console script of pyproject.toml"
    module_name, _, function = scripts[program].partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, function))
    return module_name, module.parse_args(flags)


def test_docker_compose_config_is_valid():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not on PATH; the YAML checks below still run")
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "config", "-q"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_interpolation_helper():
    assert interpolate("${A:-x}/${B}/$C/${D-y}", {"A": "a", "C": "c"}) == "a//c/y"


def test_engine_has_a_gpu_a_healthcheck_and_the_model_volume(compose):
    engine = compose["services"]["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device.get("capabilities", []) and device.get("driver") == "nvidia" for device in devices)
    assert engine["healthcheck"]["test"][0] == "CMD"
    assert any(volume.split(":")[1] == "/models" for volume in engine["volumes"])


def test_tokenizer_waits_for_a_healthy_engine_and_publishes_the_public_port(compose):
    tokenizer = compose["services"]["tokenizer"]
    assert tokenizer["depends_on"]["engine"]["condition"] == "service_healthy"
    assert f"{PUBLIC_PORT}:{PUBLIC_PORT}" in [str(port) for port in tokenizer["ports"]]
    assert any(volume.split(":")[1] == "/models" for volume in tokenizer["volumes"])


@pytest.mark.parametrize("name", ["engine", "tokenizer"])
def test_dockerfiles_exist(compose, name):
    build = compose["services"][name]["build"]
    assert (REPO_ROOT / build["context"] / build["dockerfile"]).is_file()


def test_engine_command_is_the_entry_point_the_tests_start(compose, scripts):
    module_name, args = parse_command(compose["services"]["engine"], scripts)
    assert module_name == ENTRY_MODULES["engine"]
    assert (args.host, args.port) == ("0.0.0.0", 50052)
    assert args.model == ""  # LLMSERVE_MODEL unset: main() turns "" into the embedded default model
    assert [str(port) for port in compose["services"]["engine"]["expose"]] == [str(args.port)]
    _, with_model = parse_command(compose["services"]["engine"], scripts, {"LLMSERVE_MODEL": "/models/m"})
    assert with_model.model == "/models/m"


def test_tokenizer_command_points_at_the_engine_service(compose, scripts):
    module_name, args = parse_command(compose["services"]["tokenizer"], scripts)
    assert module_name == ENTRY_MODULES["tokenizer"]
    assert (args.host, args.port) == ("0.0.0.0", PUBLIC_PORT)
    [target] = args.engine_targets
    _, engine_args = parse_command(compose["services"]["engine"], scripts)
    assert target.address in compose["services"] and target.address == "engine"
    assert target.port == engine_args.port


def test_the_engine_scales_and_the_tokenizer_finds_every_replica_by_dns(compose, scripts):
    """`docker compose up --scale engine=N`: N engine containers need no fixed name and no host port, and the
    service name resolves to all of them, which the tokenizer service resolves again as they come and go."""
    engine = compose["services"]["engine"]
    assert "container_name" not in engine and "ports" not in engine
    assert "container_name" not in compose["services"]["tokenizer"]
    _, args = parse_command(compose["services"]["tokenizer"], scripts)
    assert [target.resolvable for target in args.engine_targets] == [True]


def _seconds(duration: str) -> float:
    """A compose duration such as "5s" or "1m30s" in seconds."""
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(value) * units[unit] for value, unit in re.findall(r"([\d.]+)(ms|s|m|h)", duration))


@pytest.mark.parametrize("name, service_name", [("engine", ENGINE_SERVICE), ("tokenizer", TEXTGEN_SERVICE)])
def test_healthchecks_probe_the_services_own_port_and_readiness(compose, scripts, name, service_name):
    service = compose["services"][name]
    _, args = parse_command(service, scripts)
    kind, program, *flags = service["healthcheck"]["test"]
    assert (kind, program) == ("CMD", "llmserve")  # the client CLI, installed in both images
    probe = llmserve_cli.build_parser().parse_args(flags)
    assert probe.command == "health"
    assert probe.target == f"127.0.0.1:{args.port}"
    assert probe.service == service_name
    assert probe.timeout is not None and probe.timeout < _seconds(service["healthcheck"]["timeout"])
