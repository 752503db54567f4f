"""Fixtures shared by the whole test suite.

- ``tiny_model_dir``: the tiny Llama of ``workers.models.build_tiny_model`` (seed 0),
  built once per session (a few seconds) into a temporary directory.
- ``@pytest.mark.gpu``: a test that needs CUDA; skipped, with the reason, on a machine
  without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + tokenizer (hidden 64, 2 heads of dim 32, 2 layers, vocab 512)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests where CUDA is missing (the marker is declared in pyproject)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
