"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer ("w0".."w319", eos w2) and a chat template."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))
