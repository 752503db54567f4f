"""Imported by the fork server (``launch/forkserver.py``) after transformers: the module that
defines the run's model (``model_modules`` of the ``model.path`` that ``ForkServer.start``
put in ``YATT_FORK_SERVER_MODEL``), so that no forked role imports it at its model's first
load. Resolved here, not in the launcher, which then never imports transformers.

Importing it anywhere else does nothing."""

from __future__ import annotations

import contextlib
import importlib
import os

from launch.forkserver import MODEL_ENV, model_modules

if (path := os.environ.pop(MODEL_ENV, None)) is not None:
    for module in model_modules(path):
        with contextlib.suppress(ImportError):  # a role that loads the model says what is missing
            importlib.import_module(module)
