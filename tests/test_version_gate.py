"""The version gate: refuse torch < 2.0 and unrecognised torchmetrics without touching anything."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests._subprocess import WORLD_OF_ONE, fake_torchmetrics, ok, run_python
from torchmetrics_gradpatch import UnsupportedVersionError, _version

pytestmark = pytest.mark.python


def test_error_type_is_an_import_error_but_not_module_not_found() -> None:
    assert issubclass(UnsupportedVersionError, ImportError)
    assert not issubclass(UnsupportedVersionError, ModuleNotFoundError)


@pytest.mark.parametrize("version", ["1.13.1", "1.13.1+cu117", "1.9.0", "0.4.1"])
def test_torch_below_2_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as info:
        _version.require("torch", version)
    assert f"torch {version} is installed" in str(info.value)
    assert ">= 2.0" in str(info.value)


@pytest.mark.parametrize("version", ["2.0.0", "2.0.0rc1", "2.13.0+cpu", "2.16.0.dev20261101", "3.0.0a1"])
def test_torch_2_and_newer_pass_including_local_labels_and_prereleases(version: str) -> None:
    assert str(_version.require("torch", version)) == version


def test_missing_or_unparsable_versions_are_clear_errors() -> None:
    with pytest.raises(UnsupportedVersionError, match="torch is not installed: pip install"):
        _version.require("torch", None)
    with pytest.raises(UnsupportedVersionError, match="torchmetrics is not installed: pip install"):
        _version.require("torchmetrics", None)
    with pytest.raises(UnsupportedVersionError, match="cannot parse the installed torch version 'banana'"):
        _version.require("torch", "banana")


@pytest.mark.parametrize(
    ("version", "native"),
    [("0.11.4", False), ("1.5.2", False), ("1.6.0rc1", False), ("1.6.0.dev20241001", False),
     ("1.6.0", True), ("1.6.0+local", True), ("1.9.0", True), ("2.0.0", True)],
)  # fmt: skip
def test_native_from_1_6_0(version: str, native: bool) -> None:
    assert _version.is_native(_version.parse(version, "torchmetrics")) is native


# What a refused import must leave exactly as it found it, checked in a fresh interpreter.
SNAPSHOT = """
import sys
import torchmetrics, torchmetrics.metric as tm_metric, torchmetrics.utilities.distributed as tm_dist
def state():
    function = getattr(tm_dist, "gather_all_tensors", None)
    return (function, getattr(function, "__code__", None), dict(getattr(function, "__dict__", {})),
            tm_metric.gather_all_tensors, tm_metric.Metric._sync_dist.__defaults__, list(sys.meta_path))
before = state()
def unchanged():
    now = state()
    return all(a is b for a, b in zip(now[:2], before[:2])) and now[2] == before[2] and all(
        a is b for a, b in zip(now[3:5], before[3:5])) and now[5] == before[5]
def import_refused():
    try:
        import torchmetrics_gradpatch
    except ImportError as err:
        assert type(err).__name__ == "UnsupportedVersionError", repr(err)
        assert not [n for n in sys.modules if n.split(".")[0] == "torchmetrics_gradpatch"], "left in sys.modules"
        return str(err)
    raise SystemExit("import did not refuse")
"""


def test_old_torch_refused_twice_and_nothing_touched() -> None:
    out = ok(
        SNAPSHOT
        + """
import torch
torch.__version__ = "1.13.1"  # the gate reads the running torch's version
first, second = import_refused(), import_refused()
assert first == second and unchanged()
print(first)
"""
    )
    assert "torch 1.13.1 is installed" in out and ">= 2.0" in out


MUTATIONS = {
    "extra parameter": (
        "def gather_all_tensors(result, group=None, extra=1): pass",
        "unrecognised signature gather_all_tensors(result, group=None, extra=1)",
    ),
    "renamed parameter": (
        "def gather_all_tensors(tensor, group=None): pass",
        "unrecognised signature gather_all_tensors(tensor, group=None)",
    ),
    "missing": ("gather_all_tensors = None", "the function does not exist"),
    "not a Python function": (
        "gather_all_tensors = len",
        "expected a Python function, found builtin_function_or_method",
    ),
}


def test_unrecognised_torchmetrics_gather_refused_naming_why() -> None:
    """Each mutation of torchmetrics' gather is refused, with torchmetrics' version and the reason.

    On native torchmetrics the import looks at the gather only when it must install the global mode (local mode
    patches nothing there; see the future-torchmetrics tests below), so there the import is asked for it.
    """
    out = ok(
        SNAPSHOT
        + f"""
import json
original = tm_dist.gather_all_tensors
messages = {{}}
for name, (source, _) in {dict((k, v) for k, v in MUTATIONS.items())!r}.items():
    scope = dict(vars(tm_dist))  # defined as a changed torchmetrics would define it: in its own module's globals
    exec(source, vars(tm_dist), scope)
    if scope["gather_all_tensors"] is None:
        del tm_dist.gather_all_tensors
    else:
        tm_dist.gather_all_tensors = scope["gather_all_tensors"]
    before = state()
    messages[name] = import_refused()
    assert unchanged(), name
    tm_dist.gather_all_tensors = original
print(json.dumps(messages))
""",
        env=INSTALLING,
    )
    messages = json.loads(out)
    for name, (_, reason) in MUTATIONS.items():
        assert ("global mode" in messages[name]) is NATIVE, messages[name]
        assert f"torchmetrics {_version.installed_version('torchmetrics')}" in messages[name], name
        assert reason in messages[name], name


def test_native_torchmetrics_is_left_alone() -> None:
    out = ok(
        SNAPSHOT
        + """
torchmetrics.__version__ = "1.6.0"  # the gate reads the running torchmetrics' version
import torchmetrics_gradpatch as tg
status = tg.status()
assert status.native and status.in_force and status.applied_to == () and status.graph_preserving
with tg.patched():
    tg.patch(); tg.unpatch()
assert unchanged()
print(status)
"""
    )
    assert "native" in out


# On native torchmetrics (>= 1.6) local mode installs nothing by design; these tests are about the engine
# reaching torchmetrics, so there they use the global mode, which installs the same trampoline.
NATIVE = _version.is_native(_version.parse(_version.installed_version("torchmetrics") or "0", "torchmetrics"))
INSTALLING = {"TORCHMETRICS_GRADPATCH_MODE": "global"} if NATIVE else {}
GRAD_THROUGH = """
x = torch.arange(3.0, requires_grad=True)
out = gather(x)
out[0].sum().backward()
assert x.grad.tolist() == [1.0, 1.0, 1.0], "the local entry must carry the caller's graph"
"""


def test_import_before_torchmetrics_patches_on_import() -> None:
    ok(
        """
import sys
import torchmetrics_gradpatch as tg
assert "torchmetrics" not in sys.modules and tg.is_patched()
assert tg.status().applied_to == ()
import torchmetrics.utilities.distributed as tm_dist
assert tg.status().applied_to, tg.status()
gather = tm_dist.gather_all_tensors
"""
        + WORLD_OF_ONE
        + GRAD_THROUGH,
        env=INSTALLING,
    )


def test_alias_imported_before_the_shim_is_reached() -> None:
    ok(
        f"""
from torchmetrics.utilities.distributed import gather_all_tensors as gather
code = gather.__code__
{WORLD_OF_ONE}
if not {NATIVE}:  # old torchmetrics: no graph before the shim
    assert not gather(torch.arange(3.0, requires_grad=True))[0].requires_grad
import torchmetrics_gradpatch
assert gather.__code__ is not code
{GRAD_THROUGH}
""",
        env=INSTALLING,
    )


def test_autopatch_off_applies_nothing_but_keeps_the_gate(tmp_path: Path) -> None:
    ok(
        """
import torchmetrics.utilities.distributed as tm_dist
code = tm_dist.gather_all_tensors.__code__
import torchmetrics_gradpatch as tg
assert not tg.is_patched() and tm_dist.gather_all_tensors.__code__ is code and not tg.status().autopatch
tg.patch()
assert tm_dist.gather_all_tensors.__code__ is not code
tg.unpatch()
assert tm_dist.gather_all_tensors.__code__ is code
""",
        env={"TORCHMETRICS_GRADPATCH_AUTOPATCH": "0", **INSTALLING},
    )
    # No torch import (seconds): the gate then reads torch's metadata, here a stand-in 1.13.1 first on the path
    # (test_old_torch_refused_twice_and_nothing_touched covers a running torch's __version__)
    fake_torch = tmp_path / "fake-torch" / "torch-1.13.1.dist-info"
    fake_torch.mkdir(parents=True)
    (fake_torch / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 1.13.1\n")
    ok(
        """
import sys
try:
    import torchmetrics_gradpatch
except ImportError as err:
    assert "1.13.1" in str(err)
else:
    raise SystemExit("the gate must run even with autopatch off")
assert "torch" not in sys.modules, "the metadata alone must decide"
""",
        env={
            "TORCHMETRICS_GRADPATCH_AUTOPATCH": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(fake_torch.parent), os.environ.get("PYTHONPATH")])),
        },
    )


def test_bad_autopatch_value_is_a_clear_error_and_leaves_nothing() -> None:
    ok(
        """
import sys
import torchmetrics.utilities.distributed as tm_dist
code = tm_dist.gather_all_tensors.__code__
try:
    import torchmetrics_gradpatch
except ValueError as err:
    assert "TORCHMETRICS_GRADPATCH_AUTOPATCH='maybe'" in str(err) and "use one of: 0, false, no, off" in str(err), err
else:
    raise SystemExit("accepted a bad flag")
assert tm_dist.gather_all_tensors.__code__ is code
assert not [n for n in sys.modules if n.startswith("torchmetrics_gradpatch")]
""",
        env={"TORCHMETRICS_GRADPATCH_AUTOPATCH": "maybe"},
    )


# --- a future native torchmetrics whose gather gains a keyword ------------------------------------------------------


@pytest.fixture
def future_native_torchmetrics(tmp_path: Path) -> dict[str, str]:
    """``PYTHONPATH`` that puts a fake torchmetrics 1.10.0 first: metadata and module, with a gather whose signature
    the engine does not recognise (an extra keyword, as a future torchmetrics might add)."""
    root = fake_torchmetrics(tmp_path / "future", "1.10.0")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


FUTURE_UNCHANGED = """
import sys, torchmetrics.utilities.distributed as tm_dist
assert torchmetrics.__version__ == "1.10.0"
code = tm_dist.gather_all_tensors.__code__
"""


@pytest.mark.parametrize("order", ["package first", "torchmetrics first"])
def test_native_torchmetrics_with_an_unknown_gather_imports_in_local_mode(
    future_native_torchmetrics: dict[str, str], order: str
) -> None:
    """Local mode patches nothing on native torchmetrics, so the import must not even look at the gather."""
    first, second = (
        ("torchmetrics_gradpatch", "torchmetrics")
        if order == "package first"
        else ("torchmetrics", "torchmetrics_gradpatch")
    )
    out = ok(
        f"""
import {first}
import {second}
import torchmetrics_gradpatch as tg
"""
        + FUTURE_UNCHANGED
        + """
status = tg.status()
assert status.native and status.in_force and status.applied_to == () and status.mode == "local", status
assert status.torchmetrics_imported, status
with tg.patched():
    tg.patch(); tg.unpatch(); tg.patch()
assert tm_dist.gather_all_tensors.__code__ is code
print(status)
""",
        env=future_native_torchmetrics,
    )
    assert "torchmetrics:     1.10.0" in out and "native" in out


def test_global_mode_on_an_unknown_native_gather_is_refused_and_changes_nothing(
    future_native_torchmetrics: dict[str, str],
) -> None:
    out = ok(
        """
import torchmetrics, torchmetrics_gradpatch as tg
from torchmetrics_gradpatch import UnsupportedVersionError, _engine
"""
        + FUTURE_UNCHANGED
        + """
messages = []
for attempt in (lambda: tg.patch("global"), lambda: tg.patched(mode="global").__enter__()):
    try:
        attempt()
    except UnsupportedVersionError as err:
        messages.append(str(err))
    else:
        raise SystemExit("global mode was accepted on an unrecognised gather")
    assert tm_dist.gather_all_tensors.__code__ is code and not _engine.installed()
    status = tg.status()
    assert status.in_force and status.mode == "local" and _engine._state.blocks == 0, status
assert messages[0] == messages[1], messages
print(messages[0])
""",
        env=future_native_torchmetrics,
    )
    assert "torchmetrics 1.10.0" in out and "unrecognised signature" in out, out
    assert "global mode" in out and "local mode" in out, out


@pytest.mark.parametrize("order", ["package first", "torchmetrics first"])
def test_global_mode_at_import_on_an_unknown_native_gather_refuses_the_import(
    future_native_torchmetrics: dict[str, str], order: str
) -> None:
    """TORCHMETRICS_GRADPATCH_MODE=global asks the import to install: it refuses, as on an unknown old gather."""
    if order == "torchmetrics first":
        code = "import torchmetrics\nimport torchmetrics_gradpatch\n"
    else:
        code = "import torchmetrics_gradpatch\nimport torchmetrics\n"
    proc = run_python(code, env={**future_native_torchmetrics, "TORCHMETRICS_GRADPATCH_MODE": "global"})
    assert proc.returncode == 1, proc.stderr
    assert "UnsupportedVersionError" in proc.stderr and "unrecognised signature" in proc.stderr, proc.stderr


# --- torchmetrics below 0.11: refused, as the test matrix starts at 0.11 ------------------------------------------


@pytest.mark.parametrize("version", ["0.10.3", "0.10.0", "0.6.0", "0.10.3+local"])
def test_torchmetrics_below_0_11_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as info:
        _version.require("torchmetrics", version)
    assert f"torchmetrics {version} is installed" in str(info.value)
    assert "torchmetrics >= 0.11" in str(info.value) and "nothing was patched" in str(info.value)


@pytest.mark.parametrize("version", ["0.11.0", "0.11.0rc1", "0.11.4", "1.5.2", "1.9.0"])
def test_torchmetrics_0_11_and_newer_pass_including_prereleases(version: str) -> None:
    assert str(_version.require("torchmetrics", version)) == version


# The package imported twice in a process that must refuse it: each import raises the same UnsupportedVersionError,
# leaves nothing in sys.modules, and ``after_each()`` (defined by the caller's snippet) checks what must be untouched.
REFUSED_TWICE = """
messages = []
for attempt in (1, 2):
    try:
        import torchmetrics_gradpatch
    except ImportError as err:
        assert type(err).__name__ == "UnsupportedVersionError", repr(err)
        messages.append(str(err))
    else:
        raise SystemExit("the import was accepted")
    assert not [n for n in sys.modules if n.split(".")[0] == "torchmetrics_gradpatch"], "left in sys.modules"
    after_each()
assert messages[0] == messages[1], messages
print(messages[0])
"""


def test_import_refuses_torchmetrics_0_10_and_touches_nothing(tmp_path: Path) -> None:
    """A stand-in torchmetrics 0.10.3 whose gather has 0.10's very signature: refused for its version alone."""
    root = fake_torchmetrics(tmp_path / "old", "0.10.3", signature="result, group=None")
    out = ok(
        """
import sys
import torchmetrics, torchmetrics.utilities.distributed as tm_dist
assert torchmetrics.__version__ == "0.10.3"
function = tm_dist.gather_all_tensors
code = function.__code__
def after_each():
    assert tm_dist.gather_all_tensors is function and function.__code__ is code
"""
        + REFUSED_TWICE,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))},
    )
    assert "torchmetrics 0.10.3 is installed" in out and ">= 0.11" in out, out


# --- a real copy of the installed torchmetrics whose gather gains a keyword: a refusal is atomic -------------------


@pytest.fixture(scope="module")
def changed_torchmetrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``PYTHONPATH`` that puts first a copy of the installed torchmetrics package whose ``gather_all_tensors``
    gained a keyword parameter (``*, async_op: bool = False``); its version is the installed one."""
    spec = importlib.util.find_spec("torchmetrics")
    assert spec is not None and spec.submodule_search_locations, spec
    root = tmp_path_factory.mktemp("changed-torchmetrics")
    source = Path(next(iter(spec.submodule_search_locations)))
    shutil.copytree(source, root / "torchmetrics", ignore=shutil.ignore_patterns("__pycache__"))
    distributed = root / "torchmetrics" / "utilities" / "distributed.py"
    text, count = re.subn(
        r"(def gather_all_tensors\(result[^)]*?)\)", r"\1, *, async_op: bool = False)", distributed.read_text(), count=1
    )
    assert count == 1, "gather_all_tensors' definition not found in the copy"
    distributed.write_text(text)
    return {"PYTHONPATH": str(root), "TMGP_CHANGED_COPY": str(root / "torchmetrics")}


# What a process holds of torchmetrics now, and the checks that it is torchmetrics' own (the copy's) and untouched.
CHANGED = """
import json, os, sys
COPY = os.environ["TMGP_CHANGED_COPY"]
def held():
    import torchmetrics.metric as tm_metric, torchmetrics.utilities.distributed as tm_dist
    gather = tm_dist.gather_all_tensors
    return gather, gather.__code__, tm_metric.Metric.__dict__["_sync_dist"]
def own(now):
    gather, code, sync_dist = now
    assert code.co_filename == os.path.join(COPY, "utilities", "distributed.py"), code.co_filename
    assert "async_op" in code.co_varnames and code.co_name == "gather_all_tensors", code.co_varnames
    assert gather.__code__ is code and gather.__dict__ == {}, gather.__dict__
    assert sync_dist.__code__.co_filename == os.path.join(COPY, "metric.py"), sync_dist
    assert sync_dist.__qualname__ == "Metric._sync_dist" and not hasattr(sync_dist, "__wrapped__"), sync_dist
def same(before):
    now = held()
    assert all(a is b for a, b in zip(now, before)), (now, before)
def refused_again(tg, message, before, attempts):
    for name, attempt in attempts.items():
        try:
            attempt()
        except ImportError as err:
            assert type(err).__name__ == "UnsupportedVersionError" and str(err) == message, (name, repr(err), message)
        else:
            raise SystemExit(f"{name} was accepted after the refusal")
        same(before)
        assert not tg.is_patched(), name
"""


def _asked_cases() -> list[tuple[str, dict[str, str]]]:
    return [
        ("the import", {}),
        ("the import, fused sync", {"TORCHMETRICS_GRADPATCH_SYNC": "fused"}),
        ("a patched() block", {"TORCHMETRICS_GRADPATCH_AUTOPATCH": "0"}),
        ("nobody", {"TORCHMETRICS_GRADPATCH_AUTOPATCH": "0"}),
    ]


@pytest.mark.parametrize(("asked", "env"), _asked_cases(), ids=[case for case, _ in _asked_cases()])
def test_package_first_refusal_leaves_torchmetrics_its_own(
    changed_torchmetrics: dict[str, str], asked: str, env: dict[str, str]
) -> None:
    """The refusal surfaces from ``import torchmetrics``; after it nothing of torchmetrics is changed, whatever asked
    for the patch, and every later ``patch()``, ``patched()`` block or decorated call raises the same error.

    On native torchmetrics only what needs the gather (global mode, set here) is refused; with nothing asking for
    it there, the gather is first looked at by ``patch()``.
    """
    looked_at_import = asked != "nobody" or not NATIVE
    out = ok(
        CHANGED
        + f"""
import torchmetrics_gradpatch as tg
from torchmetrics_gradpatch import UnsupportedVersionError
asked, looked_at_import = {asked!r}, {looked_at_import!r}
message = None
try:
    if asked == "a patched() block":
        with tg.patched(sync="fused"):
            import torchmetrics
    else:
        import torchmetrics
except UnsupportedVersionError as err:
    message = str(err)
assert (message is not None) == looked_at_import, message
import torchmetrics  # the refused import is Python's failed import: importing again gives torchmetrics as it is
before = held()
own(before)
if message is None:  # native torchmetrics with nothing asked: the first call that needs the gather refuses
    try:
        tg.patch()
    except UnsupportedVersionError as err:
        message = str(err)
    same(before)

@tg.patched
def decorated():
    raise SystemExit("the decorated function ran")

def block():
    with tg.patched():
        raise SystemExit("the block ran")

first = tg.status()
refused_again(tg, message, before, {{
    "patch()": tg.patch, "patch(sync='fused')": lambda: tg.patch(sync="fused"), "patched()": block,
    "patched(sync='fused').__enter__()": lambda: tg.patched(sync="fused").__enter__(), "@patched": decorated,
}})
assert str(tg.status()) == str(first), (str(tg.status()), str(first))  # the calls left the state as it was
print(json.dumps({{"message": message, "text": str(first), "json": json.loads(first.to_json())}}))
""",
        env={**changed_torchmetrics, **INSTALLING, **env},
        timeout=180,
    )
    seen = json.loads(out.splitlines()[-1])
    message, text, data = seen["message"], seen["text"], seen["json"]
    version = _version.installed_version("torchmetrics")
    assert f"torchmetrics {version}" in message and "unrecognised signature" in message, message
    assert "async_op" in message and "nothing was patched" in message, message
    assert data["refused"] == message and f"refused:          {message}" in text.splitlines(), text
    assert data["in_force"] is False and data["applied_to"] == [] and data["sync_applied_to"] == [], data
    assert data["mode"] == "off" and data["torchmetrics_imported"] is True, data
    asked_now = asked == "the import" or asked == "the import, fused sync"
    assert data["state"] == ("refused" if asked_now else "off"), data
    assert data["autopatch"] is (asked_now or not env), data
    if asked_now:
        assert "in force:         no: asked for by the import, but torchmetrics was refused (see refused)" in text, text
        assert "at import:        switched the patch on (the default)" in text, text
    else:
        assert data["autopatch_variable"] == "0", data
        assert "in force:         no: TORCHMETRICS_GRADPATCH_AUTOPATCH=0 kept the import from patching" in text, text
        assert "at import:        left the patch off (TORCHMETRICS_GRADPATCH_AUTOPATCH=0)" in text, text
    assert "graph preserved:  NO" in text or NATIVE, text
    assert "applied to" not in text, text


def test_torchmetrics_first_refusal_touches_nothing(changed_torchmetrics: dict[str, str]) -> None:
    """Imported after torchmetrics, the package refuses at its own import, twice alike, and changes nothing."""
    out = ok(
        CHANGED
        + """
import torchmetrics
before = held()
own(before)
meta_path = list(sys.meta_path)
def after_each():
    same(before)
    assert sys.meta_path == meta_path, (sys.meta_path, meta_path)
"""
        + REFUSED_TWICE,
        env={**changed_torchmetrics, **INSTALLING},
        timeout=180,
    )
    assert "unrecognised signature" in out and "async_op" in out and "nothing was patched" in out, out
