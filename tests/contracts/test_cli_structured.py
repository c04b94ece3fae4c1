"""The client's structured-output options and the CLI's --json-schema / --regex / --grammar / --json-object flags
set the SamplingParams `constraint` oneof (against the fake service)."""

from __future__ import annotations

import json

import pytest

from llmserve._convert import build_generate_request
from tests.contracts.test_cli import run_cli

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


def test_a_schema_dict_is_sent_as_json_text():
    request = build_generate_request("hi", None, {"json_schema": SCHEMA})
    assert request.sampling.WhichOneof("constraint") == "json_schema"
    assert json.loads(request.sampling.json_schema) == SCHEMA


def test_two_constraints_are_refused_before_sending():
    with pytest.raises(TypeError, match="at most one"):
        build_generate_request("hi", None, {"regex": "a", "json_object": True})


def test_json_schema_flag_sends_the_file(fake_server, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA), encoding="utf-8")
    proc = run_cli("generate", "a b", "--json-schema", str(path), "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    sampling = fake_server.servicer.requests[-1].sampling
    assert sampling.WhichOneof("constraint") == "json_schema" and json.loads(sampling.json_schema) == SCHEMA


@pytest.mark.parametrize("flags, kind, value", [
    (["--regex", "[a-z]+"], "regex", "[a-z]+"),
    (["--json-object"], "json_object", True),
])
def test_regex_and_json_object_flags(fake_server, flags, kind, value):
    proc = run_cli("generate", "a b", *flags, "--target", fake_server.target)
    assert proc.returncode == 0, proc.stderr
    sampling = fake_server.servicer.requests[-1].sampling
    assert sampling.WhichOneof("constraint") == kind and getattr(sampling, kind) == value


def test_constraint_flags_are_mutually_exclusive(fake_server):
    proc = run_cli("generate", "a b", "--regex", "a", "--json-object", "--target", fake_server.target)
    assert proc.returncode == 2 and "not allowed with" in proc.stderr


def test_an_unreadable_schema_file_is_a_clean_error(fake_server, tmp_path):
    proc = run_cli("generate", "a b", "--json-schema", str(tmp_path / "missing.json"), "--target", fake_server.target)
    assert proc.returncode == 1 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr
