"""The fault suite's shared services: one tiny random-weight model, one engine + tokenizer stack for the session.

Tests that kill or drain a service leave it dead; the next test's `faults_stack` restarts it on the same port.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.stack import FaultStack


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """bench/tiny_model.py's checkpoint: a near-zero-compute Llama with the default model's tokenizer."""
    from bench.tiny_model import write_tiny_model

    directory = str(tmp_path_factory.mktemp("faults-tiny-model"))
    write_tiny_model(directory)
    return directory


@pytest.fixture(scope="session")
def _session_stack(tiny_model_dir) -> Iterator[FaultStack]:
    stack = FaultStack(tiny_model_dir)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def faults_stack(_session_stack) -> FaultStack:
    """Both services up and SERVING (restarted if a previous test ended one)."""
    _session_stack.ensure_up()
    return _session_stack
