"""The fault suite's shared services: one tiny random-weight model, one engine + tokenizer stack for the package.

Tests that kill or drain a service leave it dead; the next test's `faults_stack` restarts it on the same port.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.stack import FaultStack


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory) -> str:
    """bench/tiny_model.py's checkpoint: a near-zero-compute Llama with the default model's tokenizer."""
    from bench.tiny_model import write_tiny_model

    directory = str(tmp_path_factory.mktemp("faults-tiny-model"))
    write_tiny_model(directory)
    return directory


@pytest.fixture(scope="package")  # stopped once this package's tests are done, not at the end of the whole run
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


# A test that ends a service leaves the restart to the next one; the drains run last, the tokenizer service's
# very last, so the session restarts nothing after them.
_LAST = ("test_faults_drain.py::test_sigterm_on_the_engine", "test_faults_drain.py::test_sigterm_on_the_tokenizer")


def pytest_collection_modifyitems(items) -> None:
    positions = [i for i, item in enumerate(items) if "/tests/faults/" in str(item.path)]

    def rank(item) -> int:
        return next((1 + n for n, prefix in enumerate(_LAST) if prefix in item.nodeid), 0)

    ordered = sorted((items[i] for i in positions), key=rank)  # stable: the others keep their order
    for position, item in zip(positions, ordered):
        items[position] = item
