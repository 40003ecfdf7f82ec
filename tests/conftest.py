"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer ("w0".."w319", eos w2) and a chat template."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def spelled_dir(tmp_path_factory):
    """The tiny Llama with a tokenizer that spells text out: its answers depend on the prompt."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("spelled"), spelled=True)


@pytest.fixture(scope="session")
def embedded_checkpoint():
    """The embedded SmolLM2 as load_checkpoint(None) gives it, decoded from its GGUF once (seconds each time):
    the modules that build engines of it or check the loader share it, and none changes it."""
    from specpilot.models.checkpoint import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own load of the embedded GGUF (it dequantizes and un-permutes itself), in float32: the
    reference the engine's and the loader's tests compare with, loaded once (it takes half a minute)."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from specpilot.models.checkpoint import embedded_default_path

    path = embedded_default_path()
    # transformers parses the file twice (config, then tensors) and builds gguf's name map once per tensor:
    # two thirds of its load time. Both are read-only, so the same ones serve every call.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


# The terminal app's tests (tests/test_tui*.py): made once per session, only where asked for.
@pytest.fixture(scope="session")
def tui_model(tmp_path_factory):
    from tui_support import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tui"))


@pytest.fixture(scope="session")
def tui_db(tui_model):
    """A memory made by a real one-round `specpilot optimize` on the tiny model."""
    from tui_support import optimized_db

    return optimized_db(tui_model.parent, tui_model)


@pytest.fixture(scope="session")
def tui_server(tui_model):
    """The URL of a real `specpilot serve` on loopback."""
    from tui_support import serve

    yield from serve(tui_model)
