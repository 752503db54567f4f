"""The one loader of 'package.module:function' config values: it returns the function for
either spelling, and every way a path can be wrong is one ``PluginError`` (a
``ConfigError``) that names the field, the path, what went wrong and the fix."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from yatt.errors import ConfigError, PluginError
from yatt.runtime.plugins import load_plugin

FIELD = "buffer.custom_filter"
EXPECTS = "a function f(group) -> str"
USAGE = "buffer.custom_filter must be a function f(group) -> str, given as 'package.module:function'"


def load(path: str) -> object:
    return load_plugin(path, field=FIELD, expects=EXPECTS)


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for a user's modules; they are forgotten after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def test_both_spellings_load_the_function() -> None:
    assert load("json:dumps") is json.dumps
    assert load("json.dumps") is json.dumps
    assert issubclass(PluginError, ConfigError)


@pytest.mark.parametrize("path", ["no_separator", "json:", ":dumps", "json:dumps:x", "json:dumps.x", "json..x:f", ""])
def test_a_path_not_of_the_module_function_form_is_refused(path: str) -> None:
    with pytest.raises(PluginError) as info:
        load(path)
    assert str(info.value) == f"{FIELD}: {path!r} is not of the form 'package.module:function'. {USAGE}"


def test_a_module_that_is_not_there_says_how_to_make_it_importable() -> None:
    with pytest.raises(PluginError) as info:
        load("no_such_package.filters:keep")
    message = str(info.value)
    assert message.startswith(
        f"{FIELD}: 'no_such_package.filters:keep' cannot be imported "
        "(ModuleNotFoundError: No module named 'no_such_package'); install its package or add its directory "
        "to PYTHONPATH (check: python -c 'import no_such_package.filters')."
    )
    assert message.endswith(USAGE)
    assert info.value.__cause__ is None  # importlib's own frames would only hide the point


def test_a_module_that_fails_on_import_chains_its_error(user_modules: Path) -> None:
    (user_modules / "broken_filters.py").write_text("import no_such_dependency\n\ndef keep(group):\n    return ''\n")
    with pytest.raises(PluginError) as info:
        load("broken_filters:keep")
    message = str(info.value)
    assert message.startswith(
        f"{FIELD}: 'broken_filters:keep' cannot be imported (ModuleNotFoundError: No module named "
        "'no_such_dependency'); fix the error that importing 'broken_filters' raised (its traceback is above)."
    )
    assert isinstance(info.value.__cause__, ModuleNotFoundError)

    (user_modules / "raising_filters.py").write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(PluginError, match=r"cannot be imported \(RuntimeError: no GPU here\); fix the error") as info:
        load("raising_filters:keep")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_missing_function_names_the_module_and_a_close_name() -> None:
    with pytest.raises(PluginError) as info:
        load("json:JSONDecodr")
    assert str(info.value) == (
        f"{FIELD}: 'json:JSONDecodr': module 'json' has no attribute 'JSONDecodr'; correct the name, perhaps "
        f"to 'json:JSONDecoder'. {USAGE}"
    )
    with pytest.raises(PluginError) as info:
        load("json:nothing_like_it")
    assert str(info.value) == (
        f"{FIELD}: 'json:nothing_like_it': module 'json' has no attribute 'nothing_like_it'; "
        f"define it in 'json' or correct the name. {USAGE}"
    )


def test_an_attribute_that_is_not_callable_is_refused(user_modules: Path) -> None:
    (user_modules / "constants.py").write_text("THRESHOLD = 0.5\n")
    with pytest.raises(PluginError) as info:
        load("constants:THRESHOLD")
    assert str(info.value) == f"{FIELD}: 'constants:THRESHOLD' is not a function (its type is float). {USAGE}"
