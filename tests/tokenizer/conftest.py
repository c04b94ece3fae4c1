"""One real default-model tokenizer per test session (loading it takes seconds)."""

import pytest

from services.tokenizer.tokenizer import TextTokenizer


@pytest.fixture(scope="session")
def text_tokenizer() -> TextTokenizer:
    return TextTokenizer.load(None)
