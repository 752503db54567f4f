"""The one loader of a user's function named in the config as 'package.module:function'.

Why a module of its own: custom scorers, buffer filters and policy losses (and, next,
environments) are all named this way, and a bad name must fail the same way wherever it is
written: one ``PluginError`` that names the dotted config field, the path, what went wrong
and the fix. The runtime knows no RL, so what the function must look like comes from the
caller, in words (``expects``); checks of its signature stay with the caller too.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

from yatt.errors import PluginError


def load_plugin(path: str, *, field: str, expects: str) -> Callable[..., object]:
    """The function ``path`` names: 'package.module:function' or 'package.module.function'.

    ``field`` is the dotted config field that holds ``path``; ``expects`` says what it must
    name, e.g. "a function f(group: ScoredGroup) -> str". ``PluginError`` when ``path`` is
    malformed, its module does not import (an error inside the module is chained, so its
    traceback shows), the module has no such attribute, or the attribute is not callable.
    """
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    usage = f"{field} must be {expects}, given as 'package.module:function'"
    if not (attr.isidentifier() and all(part.isidentifier() for part in module_name.split("."))):
        raise PluginError(f"{field}: {path!r} is not of the form 'package.module:function'. {usage}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user's module may raise anything while it is imported
        missing = (
            isinstance(e, ModuleNotFoundError) and bool(e.name) and f"{module_name}.".startswith(f"{e.name}.")
        )
        fix = (
            f"install its package or add its directory to PYTHONPATH (check: python -c 'import {module_name}')"
            if missing
            else f"fix the error that importing {module_name!r} raised (its traceback is above)"
        )
        raise PluginError(
            f"{field}: {path!r} cannot be imported ({type(e).__name__}: {e}); {fix}. {usage}"
        ) from (None if missing else e)
    try:
        fn: object = getattr(module, attr)
    except AttributeError:
        close = difflib.get_close_matches(
            attr, [name for name in dir(module) if not name.startswith("_")], n=1
        )
        fix = (
            f"correct the name, perhaps to '{module_name}:{close[0]}'"
            if close
            else f"define it in {module_name!r} or correct the name"
        )
        raise PluginError(
            f"{field}: {path!r}: module {module_name!r} has no attribute {attr!r}; {fix}. {usage}"
        ) from None
    if not callable(fn):
        raise PluginError(f"{field}: {path!r} is not a function (its type is {type(fn).__name__}). {usage}")
    return fn
