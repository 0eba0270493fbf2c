"""The environment registry: real entry points (dist-info on sys.path) and module references."""

from __future__ import annotations

import textwrap

import pytest

from miles_env.checks import ChecksEnvironment
from miles_env.environment import Environment
from miles_env.errors import RegistryError, TaskError
from miles_env.registry import list_environments, load_environment, make_task, validate_environment
from miles_env.types import Task

_MODULE = """
from miles_env.checks import ChecksEnvironment
from miles_env.types import Task


def _t(i, split="train", **kw):
    return Task(id=f"t{i}", env=kw.pop("env", "tiny"), instruction="write a", split=split,
                verifier=kw.pop("verifier", {"checks": [{"kind": "file_exists", "path": "a"}]}),
                solution="touch a", **kw)


class Tiny(ChecksEnvironment):
    name = "tiny"
    description = "two tasks"

    def tasks(self, split=None):
        ts = [_t(1), _t(2, "test")]
        return [t for t in ts if split is None or t.split == split]


def make_tiny():
    return Tiny()


def not_an_env():
    return 42


class BadSplit(Tiny):
    def tasks(self, split=None):
        return [_t(1, "test")]


class DupIds(Tiny):
    def tasks(self, split=None):
        return [_t(1), _t(1)] if split == "train" else []


class BadCheck(Tiny):
    def tasks(self, split=None):
        bad = {"checks": [{"kind": "file_equals", "path": "a", "txt": "x"}]}
        return [_t(3, verifier=bad)] if split == "train" else []


class BadField(Tiny):
    def tasks(self, split=None):
        return [Task(id="t9", env="tiny", instruction="")] if split == "train" else []
"""


@pytest.fixture
def tiny_module(tmp_path, monkeypatch):
    (tmp_path / "tiny_env_mod.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tiny_env_mod"


def _dist(tmp_path, monkeypatch, dist: str, entry: str, module_src: str) -> None:
    """A real installed distribution: a dist-info directory with entry_points.txt on sys.path."""
    info = tmp_path / f"{dist}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[miles_env.environments]\n{entry}\n")
    mod = entry.split("=")[1].strip().split(":")[0]
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(module_src))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_module_reference_loads_a_class_and_a_factory(tiny_module):
    env = load_environment(f"{tiny_module}:Tiny")
    assert isinstance(env, ChecksEnvironment) and env.name == "tiny"
    assert [t.id for t in env.tasks("train")] == ["t1"]
    assert isinstance(load_environment(f"{tiny_module}:make_tiny"), Environment)


def test_module_reference_errors_are_registry_errors(tiny_module):
    with pytest.raises(RegistryError, match="not an Environment"):
        load_environment(f"{tiny_module}:not_an_env")
    with pytest.raises(RegistryError, match="AttributeError"):
        load_environment(f"{tiny_module}:Missing")
    with pytest.raises(RegistryError, match="ModuleNotFoundError"):
        load_environment("no_such_module_xyz:Env")
    with pytest.raises(RegistryError, match="module.path:attr"):
        load_environment(":Env")


def test_unknown_name_lists_known_and_suggests_close_matches():
    with pytest.raises(RegistryError) as exc:
        load_environment("terminal-basix")
    msg = str(exc.value)
    assert "unknown environment 'terminal-basix'" in msg
    assert "did you mean 'terminal-basics'" in msg
    assert "known: " in msg and "terminal-hard" in msg


def test_entry_point_is_found_with_its_distribution(tmp_path, monkeypatch):
    src = """
    from miles_env.checks import ChecksEnvironment
    from miles_env.types import Task

    class Pkg(ChecksEnvironment):
        description = "from a package"
        def tasks(self, split=None):
            t = Task(id="p1", env="pkg-env", instruction="i", verifier={"checks": [{"kind": "file_absent", "path": "x"}]})
            return [t] if split in (None, "train") else []
    """
    _dist(tmp_path, monkeypatch, "pkg-env-dist", "pkg-env = pkg_env_mod:Pkg", src)
    env = load_environment("pkg-env")
    assert env.name == "pkg-env"  # taken from the entry point when the class leaves it empty
    (info,) = [i for i in list_environments() if i.name == "pkg-env"]
    assert info.source == "pkg-env-dist 0.3"
    assert info.n_tasks == {"train": 1, "test": 0} and info.description == "from a package"
    assert info.error is None


def test_broken_entry_point_names_distribution_and_error(tmp_path, monkeypatch):
    _dist(
        tmp_path, monkeypatch, "broken-dist", "broken-env = broken_env_mod:Env", "import does_not_exist_abc\n"
    )
    with pytest.raises(RegistryError) as exc:
        load_environment("broken-env")
    msg = str(exc.value)
    assert "broken-dist" in msg and "does_not_exist_abc" in msg and "ModuleNotFoundError" in msg
    # listing does not crash: the broken one carries its error, the others still show
    infos = {i.name: i for i in list_environments()}
    assert "does_not_exist_abc" in (infos["broken-env"].error or "")
    assert infos["terminal-basics"].error is None


def test_explicit_modules_are_listed_with_source_module(tiny_module):
    infos = list_environments([f"{tiny_module}:Tiny", f"{tiny_module}:BadSplit"])
    by_name = {i.name: i for i in infos}
    tiny = by_name[f"{tiny_module}:Tiny"]
    assert tiny.source == "module" and tiny.n_tasks == {"train": 1, "test": 1}
    assert "field 'split'" in (by_name[f"{tiny_module}:BadSplit"].error or "")


@pytest.mark.parametrize(
    ("attr", "needle"),
    [
        ("BadSplit", "task 't1': field 'split' is 'test', listed under 'train'"),
        ("DupIds", "task 't1': field 'id' is duplicated"),
        ("BadCheck", "task 't3': verifier.checks[0].file_equals"),
        ("BadField", "instruction"),
    ],
)
def test_invalid_tasks_raise_task_error_naming_task_and_field(tiny_module, attr, needle):
    with pytest.raises(TaskError) as exc:
        load_environment(f"{tiny_module}:{attr}")
    assert needle in str(exc.value)
    # validate=False defers the check to the caller
    env = load_environment(f"{tiny_module}:{attr}", validate=False)
    with pytest.raises(TaskError):
        validate_environment(env)


def test_task_env_must_match_environment_name(tiny_module):
    env = load_environment(f"{tiny_module}:Tiny")
    env.name = "other"
    with pytest.raises(TaskError, match="field 'env' is 'tiny', want 'other'"):
        validate_environment(env)


def test_make_task_names_id_and_field():
    with pytest.raises(TaskError) as exc:
        make_task(id="x-1", env="e", instruction="i", split="train", solution=3)
    assert "'x-1'" in str(exc.value) and "solution" in str(exc.value)
    with pytest.raises(TaskError, match="'x-2'.*nonsense"):
        make_task(id="x-2", env="e", instruction="i", nonsense=True)
    assert isinstance(make_task(id="ok", env="e", instruction="i"), Task)
