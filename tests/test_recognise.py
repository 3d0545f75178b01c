"""Recognition by content (``torchmetrics_gradpatch.fused.recognise``) and its generated table.

The installed torchmetrics is recognised, key by key, the package's own replacements in place or not, and the digest
the runtime reads from a live function is the one the generator (``scripts/recognised.py``) reads from the release's
files. A function with one more line is not recognised; one whose docstrings, comments, annotations or layout differ
is. Another tool's wrapper is not looked through, the package's marked replacement is; an attribute that is not
there is ``"absent"``; the answers are cached and follow a replaced attribute. The digest is the same under every
Python 3.10-3.13 found (a subprocess each, parser only; a missing interpreter is a skip).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import pytest
import torchmetrics
import wrapt
from torchmetrics.collections import MetricCollection
from torchmetrics.metric import Metric

import torchmetrics_gradpatch as tg
from torchmetrics_gradpatch.fused import recognise
from torchmetrics_gradpatch.fused._recognised import RECOGNISED

ROOT = Path(__file__).resolve().parent.parent
TORCHMETRICS = Path(torchmetrics.__file__).resolve().parent
SYNC_MARK = "__torchmetrics_gradpatch_sync__"
KEY = "Metric._sync_dist"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_tmgp_recognised_script", ROOT / "scripts" / "recognised.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def installed_files(path: str) -> str | None:
    """The generator's reader over the installed torchmetrics (``torchmetrics/metric.py`` -> its text)."""
    file = TORCHMETRICS.parent / path
    return file.read_text(encoding="utf-8") if file.is_file() else None


def original(name: str) -> Any:
    """``Metric``'s own ``name``, through the package's replacement where it is in place."""
    raw = vars(Metric)[name]
    return raw.__wrapped__ if getattr(raw, SYNC_MARK, False) else raw


def recompiled(fn: Any, tmp_path: Path, edit: Callable[[str], str]) -> FunctionType:
    """``fn`` compiled again from its own (dedented, then edited) source, written to a file so that it has one."""
    source = edit(textwrap.dedent(inspect.getsource(fn)))
    path = tmp_path / f"edited_{len(list(tmp_path.iterdir()))}.py"
    path.write_text(source, encoding="utf-8")
    namespace = dict(fn.__globals__)
    exec(compile(source, str(path), "exec"), namespace)
    made = namespace[fn.__name__]
    assert type(made) is FunctionType
    return made


def via_ast(change: Callable[[ast.FunctionDef], None]) -> Callable[[str], str]:
    def edit(source: str) -> str:
        tree = ast.parse(source)
        node = tree.body[0]
        assert isinstance(node, ast.FunctionDef)
        change(node)
        return ast.unparse(tree) + "\n"

    return edit


def with_comments(source: str) -> str:
    """A comment line before every statement, at its indentation."""
    lines = source.splitlines(keepends=True)
    starts = sorted({node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.stmt)}, reverse=True)
    for lineno in starts:
        line = lines[lineno - 1]
        lines.insert(lineno - 1, line[: len(line) - len(line.lstrip())] + "# a comment that changes nothing\n")
    return "".join(lines)


def set_docstring(text: str | None) -> Callable[[ast.FunctionDef], None]:
    def change(node: ast.FunctionDef) -> None:
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body.pop(0)
        if text is not None:
            node.body.insert(0, ast.Expr(ast.Constant(text)))

    return change


def other_annotations(node: ast.FunctionDef) -> None:
    for inner in ast.walk(node):
        if isinstance(inner, ast.arg):
            inner.annotation = ast.Name("object") if inner.annotation is None else None
        elif isinstance(inner, ast.FunctionDef):
            inner.returns = ast.Constant("Whatever")


def one_more_line(node: ast.FunctionDef) -> None:
    node.body.insert(len(node.body) - 1, ast.parse("_unused = None").body[0])


# --- the installed torchmetrics -------------------------------------------------------------------------------------


@pytest.mark.python
def test_every_key_of_the_installed_torchmetrics_is_recognised(restore_patch_state: None) -> None:
    assert set(RECOGNISED) == set(recognise.KEYS)
    assert recognise.unrecognised() == [], {key: recognise.digest_of(key) for key in recognise.unrecognised()}
    assert all(recognise.digest_of(key) != recognise.UNKNOWN for key in recognise.KEYS)
    assert all(recognise.releases_of(key, recognise.digest_of(key)) for key in recognise.KEYS)
    tg.patch(sync="fused")  # every replacement of the package in place: each is looked through
    assert vars(MetricCollection)["compute"].__torchmetrics_gradpatch_collection__
    assert vars(MetricCollection)["forward"].__torchmetrics_gradpatch_step__
    assert recognise.unrecognised() == []
    tg.unpatch()
    assert recognise.unrecognised() == []


@pytest.mark.python
def test_the_runtime_digest_is_the_generators_digest_of_the_release_files() -> None:
    """What ``inspect.getsource`` of the live functions gives is what the generator reads from the files."""
    from_files = load_script().digests(recognise, installed_files)
    assert from_files == {key: recognise.digest_of(key) for key in recognise.KEYS}


def test_the_table_is_what_the_generator_renders() -> None:
    """The table on disk is ``render``'s text for its own digests (nobody edited it by hand), and the spans read
    back to every covered release and the main branch for every key."""
    script = load_script()
    labels = [*script.RELEASES, script.MAIN]
    columns: dict[str, dict[str, str]] = {label: {} for label in labels}
    for key, found in RECOGNISED.items():
        for value, where in found.items():
            assert value == recognise.ABSENT or (len(value) == 16 and int(value, 16) >= 0), value
            for part in where.split(", "):
                first, _, last = part.partition("-")
                span = labels[labels.index(first) : labels.index(last or first) + 1]
                assert all(key not in columns[label] for label in span), (key, part)
                for label in span:
                    columns[label][key] = value
    assert all(set(column) == set(recognise.KEYS) for column in columns.values())
    table = ROOT / "torchmetrics_gradpatch" / "fused" / "_recognised.py"
    assert script.render(list(recognise.KEYS), columns) == table.read_text(encoding="utf-8")
    assert script.main_from_table(table) == columns[script.MAIN]
    assert script.spans(["0.11.0", "0.11.1", "1.0.0", "1.9.0", "main"]) == "0.11.0-0.11.1, 1.0.0, 1.9.0, main"


# --- what counts as a change ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda source: source, id="the same source"),
        pytest.param(via_ast(lambda node: None), id="reformatted (ast.unparse)"),
        pytest.param(via_ast(set_docstring("Another docstring.")), id="another docstring"),
        pytest.param(via_ast(set_docstring(None)), id="no docstring"),
        pytest.param(with_comments, id="comments"),
        pytest.param(via_ast(other_annotations), id="annotations"),
    ],
)
def test_what_cannot_change_behaviour_is_recognised(
    edit: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    edited = recompiled(original("_sync_dist"), tmp_path, edit)
    assert edited is not original("_sync_dist")
    monkeypatch.setattr(Metric, "_sync_dist", edited)
    assert recognise.unrecognised([KEY]) == []


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(via_ast(one_more_line), id="one more line"),
        pytest.param(lambda source: "@torch.jit.unused\n" + source, id="a decorator"),
        pytest.param(via_ast(lambda node: node.body.pop()), id="one line less"),
    ],
)
def test_a_changed_function_is_not_recognised(
    edit: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    edited = recompiled(original("_sync_dist"), tmp_path, edit)
    monkeypatch.setattr(Metric, "_sync_dist", edited)
    assert recognise.unrecognised([KEY, "Metric.sync"]) == [KEY]
    assert recognise.digest_of(KEY) not in (recognise.ABSENT, recognise.UNKNOWN)


def test_the_digest_leaves_out_positions_docstrings_comments_annotations(tmp_path: Path) -> None:
    base = '''
        def f(a: int, *args: str, b: "float" = 1.0, **kw: object) -> list[int]:
            """Doc."""
            total: int = a  # why

            def inner(x: int) -> int:
                """Inner doc."""
                return x + 1

            return [inner(total), len(args), int(b), len(kw), f"{a!r:>{b}}"]
        '''
    same = [
        """
        class Holder:
            def f(a, *args, b=1.0, **kw):
                total: float = a
                def inner(x):
                    return x + 1
                return [inner(total), len(args), int(b), len(kw), f'{a!r:>{b}}']
        """,
        '''
        def f(a, *args, b=1.0, **kw):
            """Other doc."""
            # a comment
            total: "Any" = a
            def inner(x: float):
                "Another."
                return (x + 1)
            return [
                inner(total), len(args), int(b), len(kw), f"{a!r:>{b}}",
            ]
        ''',
    ]
    different = [
        base.replace("total: int = a", "total = a"),  # the annotated assignment stays, only its annotation goes
        base.replace('b: "float" = 1.0', "b=2.0"),
        base.replace("return x + 1", "return x + 2"),
        base.replace("!r:>", "!s:>"),
        base.replace(
            "            total: int = a  # why",
            "            @staticmethod\n            def g(): pass\n            total: int = a",
        ),
        base.replace("def f(", "@keep\n        def f("),  # a decorator that returns the function itself
    ]

    def digest(source: str) -> str:
        path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.py"
        path.write_text(textwrap.dedent(source), encoding="utf-8")
        namespace: dict[str, Any] = {"keep": lambda fn: fn}
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
        fn = namespace["f"] if "f" in namespace else vars(namespace["Holder"])["f"]
        found = recognise.digest(fn)
        assert found is not None
        owner = "Holder" if "Holder" in namespace else None
        assert found == recognise.digest_in_module(path.read_text(encoding="utf-8"), owner, "f")
        return found

    reference = digest(base)
    assert [digest(source) for source in same] == [reference] * len(same)
    assert len({reference, *map(digest, different)}) == 1 + len(different)


def test_no_source_no_digest() -> None:
    namespace: dict[str, Any] = {}
    exec("def f():\n    return 1\n", namespace)  # no file behind it
    assert recognise.digest(namespace["f"]) is None
    assert recognise.digest(len) is None
    assert recognise.digest(functools.partial(print)) is None
    assert recognise.digest(lambda: 1) is None  # a lambda is no def


# --- wrappers -------------------------------------------------------------------------------------------------------


def foreign(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def ours(fn: Any, mark: str = SYNC_MARK) -> Any:
    """What ``_site.Site`` installs: a wrapper carrying the marker, the original in ``__wrapped__``."""
    replacement = foreign(fn)
    setattr(replacement, mark, True)
    return replacement


def test_another_tools_wrapper_is_not_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    sync_dist = original("_sync_dist")
    for wrapper in (
        foreign(sync_dist),
        wrapt.FunctionWrapper(sync_dist, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)),
        foreign(ours(sync_dist)),  # functools.wraps copies our marker onto theirs: one level is ours, not theirs
        ours(foreign(sync_dist)),  # ours on top of theirs
        ours(ours(sync_dist)),  # one level only
        functools.partial(sync_dist),
    ):
        monkeypatch.setattr(Metric, "_sync_dist", wrapper)
        assert recognise.unrecognised([KEY]) == [KEY], wrapper


def test_the_packages_marked_replacement_is_looked_through(monkeypatch: pytest.MonkeyPatch) -> None:
    sync_dist = original("_sync_dist")
    for mark in recognise._MARKS:
        monkeypatch.setattr(Metric, "_sync_dist", ours(sync_dist, mark))
        assert recognise.unrecognised([KEY]) == []
    unmarked = ours(sync_dist, SYNC_MARK)
    setattr(unmarked, SYNC_MARK, False)  # the marker must be set, not merely present
    monkeypatch.setattr(Metric, "_sync_dist", unmarked)
    assert recognise.unrecognised([KEY]) == [KEY]


def test_a_decorators_wrapper_must_be_the_one_its_source_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sync_context`` is a ``@contextmanager``: its wrapper is looked through; the bare generator function (whose
    source names the decorator all the same) is not recognised, nor is another tool's context manager."""
    key = "Metric.sync_context"
    generator = vars(Metric)["sync_context"].__wrapped__
    monkeypatch.setattr(Metric, "sync_context", contextlib.contextmanager(generator))
    assert recognise.unrecognised([key]) == []
    monkeypatch.setattr(Metric, "sync_context", generator)
    assert recognise.digest_of(key) == recognise.UNKNOWN
    monkeypatch.setattr(Metric, "sync_context", contextlib.contextmanager(foreign(generator)))
    assert recognise.unrecognised([key]) == [key]
    monkeypatch.setattr(Metric, "sync_context", staticmethod(vars(Metric)["sync_context"]))
    assert recognise.digest_of(key) == recognise.UNKNOWN  # a staticmethod its source does not name


# --- absence, the cache ---------------------------------------------------------------------------------------------


def test_an_absent_attribute_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("Metric._copy_state_dict", KEY):
        monkeypatch.delattr(Metric, key.split(".")[1], raising=False)
        assert recognise.digest_of(key) == recognise.ABSENT
        # recognised exactly where a covered release lacks it (``_copy_state_dict`` came in 1.4, ``_sync_dist`` is
        # in every release)
        assert recognise.is_recognised(key) is (recognise.ABSENT in RECOGNISED[key])
    assert recognise.unrecognised(["Metric._copy_state_dict", KEY]) == [KEY]
    monkeypatch.setitem(recognise.TARGETS, "Nowhere.f", recognise.Target("tmgp_not_imported", "Nowhere", "f"))
    monkeypatch.setitem(recognise.TARGETS, "NoClass.f", recognise.Target("torchmetrics.metric", "torch", "f"))
    monkeypatch.setitem(recognise.TARGETS, "NoSuchClass.f", recognise.Target("torchmetrics.metric", "NoSuch", "f"))
    assert recognise.digest_of("Nowhere.f") == recognise.ABSENT
    assert recognise.digest_of("NoSuchClass.f") == recognise.ABSENT
    assert recognise.digest_of("NoClass.f") == recognise.UNKNOWN
    assert recognise.unrecognised(["Nowhere.f"]) == ["Nowhere.f"]  # a key the table lacks is never recognised
    with pytest.raises(KeyError):
        recognise.digest_of("Metric.no_such_key")


def test_the_answers_are_cached_and_follow_a_replaced_attribute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync_dist = original("_sync_dist")
    first = recognise.digest(sync_dist)
    assert recognise.unrecognised() == []
    with monkeypatch.context() as m:
        m.setattr(inspect, "getsource", lambda _: pytest.fail("read again"))
        assert recognise.digest(sync_dist) == first  # one dict lookup: the code object's digest
        assert recognise.unrecognised() == recognise.unrecognised() == []

    watch = recognise.Watch([KEY, "Metric.sync"])
    assert watch.changed()
    assert not watch.changed()
    before = recognise.snapshot()
    edited = recompiled(sync_dist, tmp_path, via_ast(one_more_line))
    same = recompiled(sync_dist, tmp_path, lambda source: source)
    with monkeypatch.context() as m:
        m.setattr(Metric, "_sync_dist", edited)
        assert watch.changed()
        assert not watch.changed()
        assert recognise.unrecognised() == [KEY]
        assert recognise.unrecognised() == [KEY]
        m.setattr(Metric, "_sync_dist", same)
        assert recognise.unrecognised() == []
        same.__code__ = edited.__code__  # the same object changed in place
        assert watch.changed()
        assert recognise.unrecognised() == [KEY]
    assert watch.changed()
    assert recognise.unrecognised() == []
    assert all(a is b for a, b in zip(recognise.snapshot(), before, strict=True))


# --- the same digest on every Python --------------------------------------------------------------------------------

#: Methods and a function that use the syntax where parsers of different Pythons might differ (f-strings, walrus,
#: match, a multi-line string with lines less indented than the def), through the decorators that are looked through.
FIXTURE = '''\
import contextlib
from contextlib import contextmanager


class Thing:
    @contextmanager
    def context(self, flag: bool = True):
        """Doc."""
        yield f"{flag!r:>10} {self!s:{flag}} {{}} {flag=}"

    @staticmethod
    def static(x: int) -> int:
        text = """a
  b"""
        return len(text) + x, (
1)

    @classmethod
    @contextlib.asynccontextmanager
    async def managed(cls, *a: int, k: "str" = 'x', **kw: object) -> dict:
        total: int = sum(a)

        def inner(y, /, *, z=None):
            """Inner."""
            return y * 2  # a comment

        if (n := len(kw)) > 0:
            total += n
        match k:
            case "x" | "y":
                total += 1
            case {"a": [1, *rest]} if rest:
                pass
            case _:
                pass
        async with cls() as c:
            yield {"t": inner(total), **kw, 1: b"\\x00", 2: 1e300 * 10, 3: 2j, 4: ..., 5: -0.0, 6: c}


def plain(a, /, b, *, c=lambda q: q + 1):
    """Doc."""
    global G
    return [i for i in a if i] or {b: c(b) for b in range(3)} or (yield from a)
'''
FIXTURE_KEYS = {
    "Thing.context": ("Thing", "context"),
    "Thing.static": ("Thing", "static"),
    "Thing.managed": ("Thing", "managed"),
    "plain": (None, "plain"),
}

#: Run by each interpreter: the digests of the fixture's functions, live and from its file, and of every key in the
#: installed torchmetrics' files; recognise.py loaded by its path (no torch, no package import).
PROBE = """
import importlib.util, json, sys
recognise_path, fixture_path, torchmetrics_dir, keys = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
r = load("_probe_recognise", recognise_path)
load("tmgp_fixture", fixture_path)
fixture_text = open(fixture_path, encoding="utf-8").read()
out = {"live": {}, "file": {}, "torchmetrics": {}}
for key, (owner, name) in keys.items():
    r.TARGETS[key] = r.Target("tmgp_fixture", owner, name)
    out["live"][key] = r.digest_of(key)
    out["file"][key] = r.digest_in_module(fixture_text, owner, name)
for key, target in r.TARGETS.items():
    if target.module.startswith("torchmetrics."):
        path = torchmetrics_dir + "/" + "/".join(target.module.split(".")[1:]) + ".py"
        out["torchmetrics"][key] = r.digest_in_module(open(path, encoding="utf-8").read(), target.owner, target.name)
print(json.dumps(out, sort_keys=True))
"""


def interpreter(version: str) -> str | None:
    """``python3.X`` from PATH, else from pyenv's versions; None when none runs."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), reverse=True)
    for candidate in [shutil.which(f"python{version}"), *found]:
        if candidate and subprocess.run([candidate, "-c", "pass"], capture_output=True, check=False).returncode == 0:
            return candidate
    return None


def probe(python: str, fixture: Path) -> dict[str, dict[str, str]]:
    args = [str(Path(recognise.__file__).resolve()), str(fixture), str(TORCHMETRICS), json.dumps(FIXTURE_KEYS)]
    done = subprocess.run([python, "-I", "-c", PROBE, *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, dict[str, str]] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="module")
def fixture_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recognise") / "tmgp_fixture.py"
    path.write_text(FIXTURE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(fixture_file: Path) -> dict[str, dict[str, str]]:
    """This interpreter's answers."""
    return probe(sys.executable, fixture_file)


def test_the_probe_reads_the_fixture_live_and_from_its_file(reference: dict[str, dict[str, str]]) -> None:
    assert reference["live"] == reference["file"]
    assert len(set(reference["live"].values())) == len(FIXTURE_KEYS)
    assert recognise.UNKNOWN not in reference["live"].values()
    assert reference["torchmetrics"] == {key: recognise.digest_of(key) for key in recognise.KEYS}


@pytest.mark.once
@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12", "3.13"])
def test_the_digest_is_the_same_on_every_python(
    version: str, fixture_file: Path, reference: dict[str, dict[str, str]]
) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no python{version} found (PATH, pyenv)")
    assert probe(python, fixture_file) == reference
