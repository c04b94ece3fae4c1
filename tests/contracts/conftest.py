"""Shared fixtures: one fake TextGenerationService per test session, and loaders for the tools/ scripts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from tests.contracts.fake_textgen import FakeTextGeneration, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py (tools/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"llmserve_tools_{name}", REPO_ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass(slots=True)
class FakeServer:
    """A running fake: its address and the servicer (which records requests)."""

    target: str
    servicer: FakeTextGeneration


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    server, port, servicer = start_server()
    yield FakeServer(f"127.0.0.1:{port}", servicer)
    server.stop(grace=None)
