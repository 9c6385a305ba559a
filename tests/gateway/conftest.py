"""Gateway fixtures: the bundled model's tokenizer (ours and transformers' reference)."""

from __future__ import annotations

import pytest

from gateway.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir):
    """transformers' tokenizer for the same directory: the reference, test-only."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))
