"""Recognition whole (``torchmetrics_gradpatch.fused.recognise``) and its generated table.

The installed torchmetrics and lightning_utilities are recognised, the package's own replacements and the patched
gather's trampoline in place or not, and the module digests the runtime reads are the ones the generator
(``scripts/recognised.py``) reads from the release's files. What breaks silently otherwise is not recognised, each
named: a transparent wrapper bound where torchmetrics.metric imports a name (before or after metrics are made), a
changed ``dim_zero_sum`` or ``_flatten``, ``Metric._sync_dist`` rebuilt from its own code with other globals,
defaults or closures or with its code replaced in place, another tool's wrapper, a builtin shadowed, a name deleted,
a module whose source no release has. Putting each back is recognised again, and a steady look judges nothing
again. The digest is the same under every Python 3.10-3.13 found (a subprocess each, parser only; a missing
interpreter is a skip).
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
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any
from unittest import mock

import pytest
import torchmetrics
import torchmetrics.metric as tm_metric
import torchmetrics.utilities.data as tm_data
import wrapt
from torchmetrics import MeanSquaredError
from torchmetrics.collections import MetricCollection
from torchmetrics.metric import Metric

import torchmetrics_gradpatch as tg
from tests import _digests
from torchmetrics_gradpatch import _engine
from torchmetrics_gradpatch._site import MARKS
from torchmetrics_gradpatch.fused import recognise
from torchmetrics_gradpatch.fused._recognised import RECOGNISED

ROOT = Path(__file__).resolve().parent.parent
#: the modules recognised whole that are imported here (lightning_utilities only where torchmetrics imports it: 1.x)
IMPORTED = [name for name in recognise.MODULES if name in sys.modules]
TORCHMETRICS = Path(torchmetrics.__file__).resolve().parent
SYNC_MARK = "__torchmetrics_gradpatch_sync__"
SYNC_DIST = "torchmetrics.metric.Metric._sync_dist"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_tmgp_recognised_script", ROOT / "scripts" / "recognised.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def installed_files(path: str) -> str | None:
    """The generator's reader over the installed packages (``torchmetrics/metric.py`` -> its text)."""
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


@pytest.fixture(autouse=True)
def recognised_before_and_after() -> Iterator[None]:
    """Every test starts and ends with everything recognised (what it changed is put back)."""
    assert recognise.unrecognised() == ()
    yield
    assert recognise.unrecognised() == ()


# --- the installed torchmetrics -------------------------------------------------------------------------------------


@pytest.mark.python
def test_the_installed_modules_are_recognised_with_every_replacement_of_the_package(
    restore_patch_state: None,
) -> None:
    assert [name for name in recognise.MODULES if name.startswith("torchmetrics.")] == IMPORTED[:5]
    tg.patch(mode="global", sync="fused")  # every replacement in place, and the gather running the trampoline
    assert _engine.installed() and _engine._state.function.__code__ is not _engine._state.original_code
    assert vars(Metric)["_sync_dist"].__torchmetrics_gradpatch_sync__
    assert vars(MetricCollection)["compute"].__torchmetrics_gradpatch_collection__
    assert vars(MetricCollection)["forward"].__torchmetrics_gradpatch_step__
    assert recognise.unrecognised() == ()
    tg.unpatch()
    assert not _engine.installed()
    assert recognise.unrecognised() == ()


@pytest.mark.python
def test_the_runtime_digests_are_the_generators_digests_of_the_release_files() -> None:
    """The live modules' sources are the installed files, the table has them for the installed releases."""
    script = load_script()
    from_files = script.digests(recognise, installed_files, "torchmetrics")
    from_files.update(script.digests(recognise, installed_files, "lightning_utilities"))
    live = {name: recognise.module_digest(inspect.getsource(sys.modules[name])) for name in IMPORTED}
    assert {name: from_files[name] for name in IMPORTED} == live
    for name, found in live.items():
        version = sys.modules[recognise.MODULES[name]].__version__
        spans = recognise.releases_of(name, found)
        assert spans and covers(script, spans, version, recognise.MODULES[name]), (name, version, spans)


def covers(script: ModuleType, spans: str, version: str, package: str) -> bool:
    releases = list(script.RELEASES if package == "torchmetrics" else script.LU_RELEASES)
    for part in spans.split(", "):
        first, _, last = part.partition("-")
        if part != script.MAIN and version in releases[releases.index(first) : releases.index(last or first) + 1]:
            return True
    return False


def test_the_table_is_what_the_generator_renders() -> None:
    """The table on disk is ``render``'s text for its own digests (nobody edited it by hand), and the spans read
    back to one digest per release of each module's package (a module a release lacks has none)."""
    script = load_script()
    releases = {"torchmetrics": [*script.RELEASES, script.MAIN], "lightning_utilities": list(script.LU_RELEASES)}
    columns: dict[str, dict[str, dict[str, str]]] = {
        package: {label: {} for label in labels} for package, labels in releases.items()
    }
    assert list(RECOGNISED) == list(recognise.MODULES)
    for module, found in RECOGNISED.items():
        labels = releases[recognise.MODULES[module]]
        for value, where in found.items():
            assert len(value) == 16 and int(value, 16) >= 0, value
            for part in where.split(", "):
                first, _, last = part.partition("-")
                span = labels[labels.index(first) : labels.index(last or first) + 1]
                for label in span:
                    assert module not in columns[recognise.MODULES[module]][label], (module, part)
                    columns[recognise.MODULES[module]][label][module] = value
    table = ROOT / "torchmetrics_gradpatch" / "fused" / "_recognised.py"
    assert script.render(recognise, columns) == table.read_text(encoding="utf-8")
    assert script.main_from_table(table) == columns["torchmetrics"][script.MAIN]
    assert all(len(column) == 5 for column in columns["torchmetrics"].values())  # every module in every release
    assert script.spans(["0.11.0", "0.11.1", "1.0.0", "1.9.0", "main"], script.RELEASES) == (
        "0.11.0-0.11.1, 1.0.0, 1.9.0, main"
    )


# --- what breaks silently otherwise ---------------------------------------------------------------------------------


def test_a_transparent_wrapper_of_metric_pys_dim_zero_cat_before_and_after_metrics_are_made() -> None:
    with mock.patch("torchmetrics.metric.dim_zero_cat", wraps=tm_data.dim_zero_cat):
        made_under_it = MeanSquaredError()  # add_state read the wrapper
        assert recognise.unrecognised() == ("torchmetrics.metric.dim_zero_cat",)
    assert made_under_it is not None
    made_before = MeanSquaredError()
    with mock.patch("torchmetrics.metric.dim_zero_cat", wraps=tm_data.dim_zero_cat):
        assert recognise.unrecognised() == ("torchmetrics.metric.dim_zero_cat",)
    assert made_before is not None
    with mock.patch.object(tm_metric, "dim_zero_cat", functools.wraps(tm_data.dim_zero_cat)(lambda x: x)):
        assert recognise.unrecognised() == ("torchmetrics.metric.dim_zero_cat",)


def with_line(fn: FunctionType, tmp_path: Path) -> FunctionType:
    """``fn`` recompiled from its own source with one more line, in its own module's namespace."""
    edited = recompiled(fn, tmp_path, via_ast(one_more_line))
    return types.FunctionType(edited.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@pytest.mark.parametrize("name", ["dim_zero_sum", "dim_zero_max", "dim_zero_min", "dim_zero_cat"])
def test_a_changed_reduction_is_not_recognised_in_data_nor_where_it_is_bound(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = getattr(tm_data, name)
    holders = [sys.modules[module] for module in IMPORTED[1:] if vars(sys.modules[module]).get(name) is original]
    assert tm_metric in holders
    monkeypatch.setattr(tm_data, name, with_line(original, tmp_path))
    # the modules that import it still hold the original: not the object at their origin
    expected = (f"torchmetrics.utilities.data.{name}", *(f"{module.__name__}.{name}" for module in holders))
    assert recognise.unrecognised() == expected
    for module in holders:  # a tool that rebinds it everywhere
        monkeypatch.setattr(module, name, getattr(tm_data, name))
    assert recognise.unrecognised() == expected[:1]


def test_a_changed_flatten_is_not_recognised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tm_data, "_flatten", with_line(tm_data._flatten, tmp_path))
    assert recognise.unrecognised()[0] == "torchmetrics.utilities.data._flatten"
    assert "torchmetrics.metric._flatten" in recognise.unrecognised()


def rebuilt(fn: FunctionType, **change: Any) -> FunctionType:
    """``fn`` made again from its own code: its globals, defaults and closure as ``fn``'s unless changed."""
    made = types.FunctionType(
        change.get("code", fn.__code__),
        change.get("globals", fn.__globals__),
        fn.__name__,
        change.get("defaults", fn.__defaults__),
        change.get("closure", fn.__closure__),
    )
    made.__kwdefaults__ = change.get("kwdefaults", fn.__kwdefaults__)
    made.__qualname__ = fn.__qualname__
    return made


def test_sync_dist_rebuilt_from_its_own_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sync_dist = original("_sync_dist")
    monkeypatch.setattr(Metric, "_sync_dist", rebuilt(sync_dist))
    assert recognise.unrecognised() == ()  # as the source makes it: recognised
    other_flatten = {**sync_dist.__globals__, "_flatten": lambda x: x}
    for change in (
        {"globals": other_flatten},
        {"globals": dict(sync_dist.__globals__)},  # the same values, another namespace: a later rebinding misses it
        {"defaults": (print, None)},  # another gather
        {"defaults": (sync_dist.__defaults__[0], False)},
        {"defaults": None},
        {"code": with_line(sync_dist, tmp_path).__code__},
    ):
        monkeypatch.setattr(Metric, "_sync_dist", rebuilt(sync_dist, **change))
        assert recognise.unrecognised() == (SYNC_DIST,), change


def test_a_method_rebuilt_with_another_class_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    init = vars(Metric)["__init__"]
    assert init.__code__.co_freevars == ("__class__",)  # super() reads the cell
    other = (types.CellType(MetricCollection),)
    monkeypatch.setattr(Metric, "__init__", rebuilt(init, closure=other))
    assert recognise.unrecognised() == ("torchmetrics.metric.Metric.__init__",)
    monkeypatch.setattr(Metric, "__init__", init)
    init.__closure__[0].cell_contents = MetricCollection  # the cell changed in place: every method sharing it
    try:
        sharing = [
            f"torchmetrics.metric.Metric.{name}"
            for name, fn in vars(Metric).items()
            if isinstance(fn, FunctionType) and fn.__closure__ and fn.__closure__[0] is init.__closure__[0]
        ]
        assert "torchmetrics.metric.Metric.__init__" in sharing
        assert sorted(recognise.unrecognised()) == sorted(sharing)
    finally:
        init.__closure__[0].cell_contents = Metric


def test_code_and_defaults_changed_in_place_are_noticed(tmp_path: Path) -> None:
    sync_dist = original("_sync_dist")
    code, defaults = sync_dist.__code__, sync_dist.__defaults__
    assert recognise.unrecognised() == ()
    sync_dist.__code__ = with_line(sync_dist, tmp_path).__code__
    try:
        assert recognise.unrecognised() == (SYNC_DIST,)
    finally:
        sync_dist.__code__ = code
    assert recognise.unrecognised() == ()
    sync_dist.__defaults__ = (print, None)
    try:
        assert recognise.unrecognised() == (SYNC_DIST,)
    finally:
        sync_dist.__defaults__ = defaults


def test_a_rebinding_a_deletion_a_shadowed_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tm_metric, "apply_to_collection", lambda *a, **k: None)
    assert recognise.unrecognised() == ("torchmetrics.metric.apply_to_collection",)
    monkeypatch.undo()
    monkeypatch.delattr(tm_data, "_flatten")
    assert "torchmetrics.utilities.data._flatten" in recognise.unrecognised()
    monkeypatch.undo()
    monkeypatch.setattr(tm_metric, "len", lambda x: 0, raising=False)  # metric.py's calls of len() would read it
    assert recognise.unrecognised() == ("torchmetrics.metric.len",)
    monkeypatch.undo()
    home = sys.modules[tm_metric.apply_to_collection.__module__]  # lightning_utilities on 1.x, data.py on 0.11
    monkeypatch.setattr(home, "apply_to_collection", foreign(home.apply_to_collection))
    assert recognise.unrecognised()[0] == f"{home.__name__}.apply_to_collection"


def test_a_module_whose_source_is_no_known_release(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {name: found for name, found in RECOGNISED.items() if name != "torchmetrics.utilities.data"}
    monkeypatch.setattr(recognise, "_table", lambda: table)
    monkeypatch.setattr(recognise, "_last", [None])  # the table is no live object: look again
    assert recognise.unrecognised() == ("torchmetrics.utilities.data",)
    monkeypatch.undo()


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
        mock.Mock(wraps=sync_dist),
    ):
        monkeypatch.setattr(Metric, "_sync_dist", wrapper)
        assert recognise.unrecognised() == (SYNC_DIST,), wrapper


def test_the_packages_marked_replacement_is_looked_through(monkeypatch: pytest.MonkeyPatch) -> None:
    sync_dist = original("_sync_dist")
    for mark in MARKS:
        monkeypatch.setattr(Metric, "_sync_dist", ours(sync_dist, mark))
        assert recognise.unrecognised() == ()
    unmarked = ours(sync_dist, SYNC_MARK)
    setattr(unmarked, SYNC_MARK, False)  # the marker must be set, not merely present
    monkeypatch.setattr(Metric, "_sync_dist", unmarked)
    assert recognise.unrecognised() == (SYNC_DIST,)


def test_a_decorators_wrapper_must_be_the_one_its_source_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sync_context`` is a ``@contextmanager``: its wrapper is looked through (the generator function in its cell);
    the bare generator function is not recognised, nor another tool's context manager, nor a staticmethod."""
    name = "torchmetrics.metric.Metric.sync_context"
    generator = vars(Metric)["sync_context"].__wrapped__
    monkeypatch.setattr(Metric, "sync_context", contextlib.contextmanager(generator))
    assert recognise.unrecognised() == ()
    for other in (
        generator,
        contextlib.contextmanager(foreign(generator)),
        staticmethod(vars(Metric)["sync_context"]),
    ):
        monkeypatch.setattr(Metric, "sync_context", other)
        assert recognise.unrecognised() == (name,), other
    lying = contextlib.contextmanager(foreign(generator))
    lying.__wrapped__ = generator  # type: ignore[attr-defined]  # its cell still holds the other function
    monkeypatch.setattr(Metric, "sync_context", lying)
    assert recognise.unrecognised() == (name,)


# --- the cost -------------------------------------------------------------------------------------------------------


def test_a_steady_look_judges_nothing_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert recognise.unrecognised() == ()
    with monkeypatch.context() as m:
        m.setattr(recognise, "_Judgement", lambda: pytest.fail("judged again"))
        m.setattr(inspect, "getsource", lambda _: pytest.fail("read again"))
        assert recognise.unrecognised() == recognise.unrecognised() == ()
    changed = with_line(tm_data._flatten, tmp_path)
    with monkeypatch.context() as m:
        m.setattr(inspect, "getsource", lambda _: pytest.fail("read again"))  # the sources are cached
        m.setattr(tm_data, "_flatten", changed)
        assert recognise.unrecognised()[0] == "torchmetrics.utilities.data._flatten"


# --- the digest -----------------------------------------------------------------------------------------------------


def test_the_module_digest_leaves_out_docstrings_comments_annotations_and_layout() -> None:
    source = inspect.getsource(tm_data)
    tree = ast.parse(source)
    reference = recognise.module_digest(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            if ast.get_docstring(node) is not None:
                node.body[0] = ast.Expr(ast.Constant("Another docstring."))
            for arg in node.args.args:
                arg.annotation = None
            node.returns = None
    assert recognise.module_digest(ast.unparse(tree)) == reference
    assert recognise.module_digest("# a comment\n" + source) == reference
    assert recognise.module_digest('"""Another module docstring."""\n' + source) == reference
    assert recognise.module_digest(source + "\nMORE = 1\n") != reference
    assert recognise.module_digest(source.replace("return torch.cat(x, dim=0)", "return torch.cat(x, dim=-1)", 1)) != (
        reference
    )


def test_the_function_digest_leaves_out_positions_docstrings_comments_annotations(tmp_path: Path) -> None:
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
        base.replace("def f(", "@keep\n        def f("),  # a decorator that returns the function itself
    ]

    def digest(source: str) -> str:
        path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.py"
        path.write_text(textwrap.dedent(source), encoding="utf-8")
        namespace: dict[str, Any] = {"keep": lambda fn: fn}
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
        fn = namespace["f"] if "f" in namespace else vars(namespace["Holder"])["f"]
        found = _digests.digest(recognise, fn)
        assert found is not None
        owner = "Holder" if "Holder" in namespace else None
        assert found == _digests.digest_in_module(recognise, path.read_text(encoding="utf-8"), owner, "f")
        return found

    reference = digest(base)
    assert [digest(source) for source in same] == [reference] * len(same)
    assert len({reference, *map(digest, different)}) == 1 + len(different)


def test_no_source_no_digest() -> None:
    namespace: dict[str, Any] = {}
    exec("def f():\n    return 1\n", namespace)  # no file behind it
    assert _digests.digest(recognise, namespace["f"]) is None
    assert _digests.digest(recognise, len) is None
    assert _digests.digest(recognise, functools.partial(print)) is None
    assert _digests.digest(recognise, lambda: 1) is None  # a lambda is no def


# --- the same digest on every Python --------------------------------------------------------------------------------

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

#: Run by each interpreter: the digests of the fixture's functions (live, looked through their decorators, and from
#: its file), of the fixture module, and of every watched module in the installed packages' files; then the fixture
#: module judged whole as it is loaded and with a method replaced. recognise.py and tests/_digests.py loaded by their
#: paths (no torch, no package import).
PROBE = """
import importlib.util, json, sys
recognise_path, fixture_path, site, keys = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
r = load("_probe_recognise", recognise_path)
d = load("_probe_digests", sys.argv[5])
fixture = load("tmgp_fixture", fixture_path)
fixture_text = open(fixture_path, encoding="utf-8").read()
out = {"live": {}, "file": {}, "modules": {"fixture": r.module_digest(fixture_text)}}
for key, (owner, name) in keys.items():
    fn = vars(getattr(fixture, owner))[name] if owner else getattr(fixture, name)
    fn = getattr(fn, "__func__", fn)
    fn = getattr(fn, "__wrapped__", fn)
    out["live"][key] = d.digest(r, fn)
    out["file"][key] = d.digest_in_module(r, fixture_text, owner, name)
for module in r.MODULES:
    stem = site + "/" + module.replace(".", "/")
    for path in (stem + ".py", stem + "/__init__.py"):
        try:
            out["modules"][module] = r.module_digest(open(path, encoding="utf-8").read())
            break
        except OSError:  # not this path, or not installed here (lightning_utilities with torchmetrics 0.11)
            pass
r.MODULES.clear()
r.MODULES["tmgp_fixture"] = "fixture"
r._table = lambda: {"tmgp_fixture": {r.module_digest(fixture_text): "fixture"}}
out["judged"] = {"as loaded": list(r.unrecognised())}
fixture.Thing.static = staticmethod(lambda x: x)
out["judged"]["static replaced"] = list(r.unrecognised())
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
    args = [str(Path(recognise.__file__).resolve()), str(fixture), str(TORCHMETRICS.parent), json.dumps(FIXTURE_KEYS)]
    args.append(str(Path(_digests.__file__).resolve()))
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
    live = {name: recognise.module_digest(inspect.getsource(sys.modules[name])) for name in IMPORTED}
    assert {name: reference["modules"][name] for name in IMPORTED} == live
    # a default the source makes with a lambda is not one the judgement can vouch for: plain() is never recognised
    assert reference["judged"] == {
        "as loaded": ["tmgp_fixture.plain"],
        "static replaced": ["tmgp_fixture.Thing.static", "tmgp_fixture.plain"],
    }


@pytest.mark.once
@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12", "3.13"])
def test_the_digest_is_the_same_on_every_python(
    version: str, fixture_file: Path, reference: dict[str, dict[str, str]]
) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no python{version} found (PATH, pyenv)")
    assert probe(python, fixture_file) == reference
