"""buf lint, format and breaking checks on protos/ (tools/buf_check.py), and proof that they can fail."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.contracts.conftest import REPO_ROOT, load_tool

buf_check = load_tool("buf_check")


@pytest.fixture(scope="module")
def buf() -> str:
    path = buf_check.find_buf()
    if path is None:
        pytest.skip("buf is not installed: run `npm ci --prefix tools` (make install does)")
    return path


def copy_contracts(tmp_path: Path) -> Path:
    """A copy of buf.yaml and protos/ to break on purpose."""
    shutil.copy(REPO_ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO_ROOT / "protos", tmp_path / "protos")
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_lint(buf):
    result = buf_check.lint(buf)
    assert result.ok, result.output


def test_format(buf):
    result = buf_check.format_check(buf)
    assert result.ok, "run `tools/node_modules/.bin/buf format -w protos`:\n" + result.output


def test_no_breaking_change_against_the_v1_baseline(buf):
    result = buf_check.breaking_vs_baseline(buf)
    assert result.ok, result.output


def test_no_breaking_change_against_the_last_commit(buf):
    if not buf_check.head_has_protos():
        pytest.skip("the last commit has no protos/ yet")
    result = buf_check.breaking_vs_head(buf)
    assert result.ok, result.output


def test_breaking_check_catches_a_changed_field_type(buf, tmp_path):
    root = copy_contracts(tmp_path)
    edit(root / "protos/llmserve/common/v1/common.proto", "optional float top_p = 2;", "optional double top_p = 2;")
    result = buf_check.breaking_vs_baseline(buf, root)
    assert not result.ok
    assert "top_p" in result.output


def test_breaking_check_catches_a_renumbered_field(buf, tmp_path):
    root = copy_contracts(tmp_path)
    edit(root / "protos/llmserve/engine/v1/engine.proto", "uint32 num_waiting = 2;", "uint32 num_waiting = 20;")
    result = buf_check.breaking_vs_baseline(buf, root)
    assert not result.ok
    assert "LoadReport" in result.output


def test_lint_requires_a_comment_on_every_field(buf, tmp_path):
    root = copy_contracts(tmp_path)
    comment = "  // Number of prompt tokens (after the chat template and special tokens).\n"
    field = "  uint32 prompt_tokens = 1;"
    edit(root / "protos/llmserve/common/v1/common.proto", comment + field, field)
    result = buf_check.lint(buf, root)
    assert not result.ok
    assert "prompt_tokens" in result.output
