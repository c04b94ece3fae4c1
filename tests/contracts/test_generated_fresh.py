"""The checked-in generated code equals what protos/ generates, imports cleanly, and mirrors the proto packages."""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

import pytest
from google.protobuf import runtime_version

from tests.contracts.conftest import REPO_ROOT, load_tool

gen_protos = load_tool("gen_protos")
CLIENT_ROOT = REPO_ROOT / "clients" / "python"


def generated_modules() -> list[str]:
    """Module names of the checked-in generated .py files, e.g. llmserve.common.v1.common_pb2."""
    names = gen_protos.find_generated(CLIENT_ROOT)
    return [name[: -len(".py")].replace("/", ".") for name in names if name.endswith(".py")]


def test_checked_in_code_matches_the_protos():
    problems = gen_protos.stale_files(REPO_ROOT / "protos", CLIENT_ROOT)
    hint = "generated code is stale; run `.venv/bin/python tools/gen_protos.py`:\n"
    assert problems == [], hint + "\n".join(problems)


def test_staleness_check_catches_a_proto_edited_without_regenerating(tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(REPO_ROOT / "protos", protos)
    common = protos / "llmserve" / "common" / "v1" / "common.proto"
    text = common.read_text()
    marker = "  optional uint32 num_logprobs = 10;\n"
    assert marker in text
    common.write_text(text.replace(marker, marker + "  // An added field.\n  optional float extra = 99;\n"))
    problems = gen_protos.stale_files(protos, CLIENT_ROOT)
    assert "differs: llmserve/common/v1/common_pb2.py" in problems
    assert "differs: llmserve/common/v1/common_pb2.pyi" in problems


def test_every_generated_package_has_a_hand_written_init():
    protos = gen_protos.find_protos(REPO_ROOT / "protos")
    assert protos == [
        "llmserve/common/v1/common.proto",
        "llmserve/engine/v1/engine.proto",
        "llmserve/textgen/v1/textgen.proto",
    ]
    for proto in protos:
        parts = proto.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            package_dir = CLIENT_ROOT.joinpath(*parts[:depth])
            assert (package_dir / "__init__.py").is_file(), f"{package_dir} has no __init__.py"


@pytest.mark.parametrize("module_name", generated_modules())
def test_generated_module_imports_with_the_installed_runtime(module_name):
    module = importlib.import_module(module_name)  # the gencode checks the runtime is not older than itself
    if module_name.endswith("_pb2"):
        assert module.DESCRIPTOR.package == module_name.rsplit(".", 1)[0]  # the proto package is the import path
        header = re.search(r"^# Protobuf Python Version: (\d+)\.", Path(module.__file__).read_text(), re.M)
        assert header is not None and int(header.group(1)) == runtime_version.MAJOR


def test_messages_round_trip_across_packages():
    from llmserve.common.v1 import common_pb2
    from llmserve.engine.v1 import engine_pb2
    from llmserve.textgen.v1 import textgen_pb2

    request = textgen_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(temperature=0.0))
    decoded = textgen_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded.sampling.HasField("temperature") and not decoded.sampling.HasField("top_p")
    engine_request = engine_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=decoded.sampling)
    assert engine_pb2.GenerateRequest.FromString(engine_request.SerializeToString()) == engine_request
