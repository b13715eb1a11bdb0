"""The one importer for plug-ins named by a path (agent loops, tools, reward functions)."""

import pytest

from rolloutbus.errors import AgentLoopError, ConfigError
from rolloutbus.streams.agent_loop.tools import CalculatorTool, load_function_tools
from rolloutbus.streams.plugins import import_module, import_object
from rolloutbus.streams.reward import get_reward_fn, load_reward_fn


class Outer:
    class Inner:
        pass


NOT_CALLABLE = 42


@pytest.mark.parametrize(
    "path",
    [
        "rolloutbus.streams.agent_loop.tools.CalculatorTool",
        "rolloutbus.streams.agent_loop.tools:CalculatorTool",
    ],
)
def test_dotted_and_colon_forms(path):
    assert import_object(path, what="tool class", kind="class") is CalculatorTool


def test_nested_attributes_in_both_forms():
    assert import_object(f"{__name__}.Outer.Inner", what="x") is Outer.Inner
    assert import_object(f"{__name__}:Outer.Inner", what="x", kind="class") is Outer.Inner


def test_file_path_form_is_loaded_once(tmp_path, monkeypatch):
    path = tmp_path / "my_plugin.py"
    path.write_text("CALLS = []\n\ndef score(*args):\n    CALLS.append(args)\n    return 1.0\n")
    fn = import_object(f"{path}:score", what="reward function", kind="callable")
    assert fn() == 1.0
    monkeypatch.chdir(tmp_path)
    assert import_object("my_plugin.py:score", what="reward function") is fn  # relative to the CWD
    assert import_module(str(path), what="x") is import_module("my_plugin.py", what="x")


@pytest.mark.parametrize(
    "path, failure",
    [
        ("no_such_pkg.Ghost", "no module named 'no_such_pkg'"),
        ("no_such_pkg:Ghost", "no module named 'no_such_pkg'"),
        (
            "rolloutbus.streams.no_such_module.Loop",
            "no module named 'rolloutbus.streams.no_such_module'",
        ),
        ("rolloutbus.streams.agent_loop.tools.NoSuchTool", "has no attribute 'NoSuchTool'"),
        ("rolloutbus.streams.agent_loop.tools:Calculator.Tool", "has no attribute 'Calculator'"),
        ("missing_dir/missing.py:fn", "file 'missing_dir/missing.py' not found"),
        ("tools.py", "needs the object's name"),
        ("Ghost", "expected 'package.module.Name'"),
        ("module:", "expected 'module:Name'"),
        ("", "expected a path"),
    ],
)
def test_errors_name_the_path_what_and_the_failure(path, failure):
    with pytest.raises(AgentLoopError) as err:
        import_object(path, what="agent loop 'ghost'")
    message = str(err.value)
    assert "agent loop 'ghost'" in message and repr(path) in message and failure in message


def test_kind_checks():
    with pytest.raises(AgentLoopError, match="not a class"):
        import_object(f"{__name__}.NOT_CALLABLE", what="tool class", kind="class")
    with pytest.raises(AgentLoopError, match="int is not callable"):
        import_object(f"{__name__}:NOT_CALLABLE", what="reward function", kind="callable")


def test_the_caller_chooses_the_error_type():
    with pytest.raises(ConfigError, match="no module named 'no_such_pkg'"):
        import_object("no_such_pkg.X", what="setting", error=ConfigError)


def test_a_missing_import_inside_the_plugin_is_not_reported_as_the_plugin_missing(
    tmp_path, monkeypatch
):
    (tmp_path / "plugin_with_bad_dep.py").write_text(
        "import no_such_dependency\nclass Loop: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AgentLoopError) as err:
        import_object("plugin_with_bad_dep.Loop", what="agent loop 'x'")
    assert "importing module 'plugin_with_bad_dep' failed" in str(err.value)
    assert "no_such_dependency" in str(err.value)


def test_an_exception_while_executing_a_plugin_file_is_translated(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(
        AgentLoopError, match="executing .*broken.py' failed: RuntimeError: boom at import"
    ) as err:
        import_object(f"{path}:fn", what="function tools")
    assert isinstance(err.value.__cause__, RuntimeError)


def test_function_tools_all_naming_a_missing_function(tmp_path):
    path = tmp_path / "listed_tools.py"
    path.write_text(
        "__all__ = ['lookup', 'gone']\n\ndef lookup(key: str) -> str:\n    return key\n"
    )
    with pytest.raises(AgentLoopError, match="function tools .* has no attribute 'gone'"):
        load_function_tools(str(path))


def test_reward_function_by_path(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.25\n"
    )
    fn = load_reward_fn(f"{path}:compute_score", "test/by_path")
    assert get_reward_fn("test/by_path") is fn and fn("test/by_path", "", "", None) == 0.25
    with pytest.raises(AgentLoopError, match="reward function"):
        load_reward_fn(f"{path}:no_such_fn")
