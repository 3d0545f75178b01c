"""Run a Python snippet in a fresh interpreter: for behaviour that depends on import order or on a clean start."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def suite_path() -> str:
    """A directory holding only a link to this checkout's ``tests/``: put it on ``PYTHONPATH`` (or run there) so a
    subprocess imports ``tests...`` while ``torchmetrics_gradpatch`` still comes from site-packages. The checkout's
    root would not do: it holds the package's source, which would then shadow the installed copy."""
    where = tempfile.mkdtemp(prefix="tmgp-suite-path-")
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    (Path(where) / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    return where


def python_path(*first: str | None) -> str:
    """``PYTHONPATH`` for a subprocess: ``first`` (e.g. fake distributions), the suite, then the inherited value."""
    return os.pathsep.join(filter(None, [*first, suite_path(), os.environ.get("PYTHONPATH")]))


def run_python(
    code: str, *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with this interpreter, the suite (not the checkout's package) importable and ``env`` added to
    the environment.

    A ``PYTHONPATH`` in ``env`` comes first, so a test can put fake distributions on the path. It runs in
    :func:`suite_path`: ``-c`` puts the working directory first on ``sys.path``.
    """
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = python_path((env or {}).get("PYTHONPATH"))
    return bounded([sys.executable, "-c", textwrap.dedent(code)], full_env, timeout)


def bounded(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in :func:`suite_path`; past ``timeout`` seconds it is made to dump its Python stacks and ended,
    and the test fails with them.

    SIGABRT reaches faulthandler's C handler (``PYTHONFAULTHANDLER``), which needs no GIL: a child stuck in C code
    that holds it (gloo's teardown on torch 2.0 to 2.4) still shows where it is.
    """
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        cwd=suite_path(),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(argv)[:200]} did not finish in {timeout:g} s; its stacks:\n{err}\n--- stdout\n{out}"
        ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def ok(code: str, **kwargs: object) -> str:
    """Run ``code``; fail with its output unless it exits 0; return its stdout."""
    proc = run_python(code, **kwargs)  # type: ignore[arg-type]
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


# A one-process gloo group, enough to call the gather in a fresh interpreter. It is destroyed at exit: a process
# that ran gloo collectives and exits with its group alive may abort ("terminate called without an active
# exception"; torch 2.13 to 2.15, unpatched torchmetrics' gather too: 1 exit in 4, and every exit after a
# backward through the global mode).
#
# torch 2.0 to 2.4's gloo can deadlock in destroy_process_group while its worker thread still frees the last
# collective's tensors (it waits for the GIL the destructor holds). A program that ends right after a gather meets
# that window, so the exit first leaves the worker only a barrier's tensors, which Python does not own (as the
# world_of_one fixture does); torch 2.0 also gets 0.2 s for its worker to finish.
WORLD_OF_ONE = """
import atexit, gc, time, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
atexit.register(
    lambda: (
        gc.collect(),
        dist.barrier(),
        torch.__version__.startswith("2.0.") and time.sleep(0.2),
        dist.destroy_process_group(),
    )
)
"""


def fake_torchmetrics(directory: Path, version: str, signature: str = "result, group=None, *, async_op=False") -> str:
    """Write a stand-in torchmetrics ``version`` (distribution metadata and module) into ``directory``; return
    the ``PYTHONPATH`` entry that puts it before the installed one.

    Its gather has ``signature`` -- by default one with an extra keyword, as a future torchmetrics might add --
    and its ``__init__`` imports ``torchmetrics.utilities.distributed`` first, as the real one does.
    """
    (directory / f"torchmetrics-{version}.dist-info").mkdir(parents=True)
    (directory / f"torchmetrics-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torchmetrics\nVersion: {version}\n"
    )
    (directory / "torchmetrics" / "utilities").mkdir(parents=True)
    (directory / "torchmetrics" / "__init__.py").write_text(
        f'__version__ = "{version}"\nimport torchmetrics.utilities.distributed\n'
    )
    (directory / "torchmetrics" / "utilities" / "__init__.py").write_text("")
    (directory / "torchmetrics" / "utilities" / "distributed.py").write_text(
        f"def gather_all_tensors({signature}):\n    return [result]\n"
    )
    return str(directory)


def cli(
    *args: str,
    env: dict[str, str] | None = None,
    pythonpath: list[str] | None = None,
    command: list[str] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    """Run the CLI (``python -m torchmetrics_gradpatch`` unless ``command`` says otherwise) in a fresh process, in
    :func:`suite_path` (``-m`` puts the working directory first on ``sys.path``)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = python_path(*(pythonpath or []))
    return bounded([*(command or [sys.executable, "-m", "torchmetrics_gradpatch"]), *args], full_env, timeout)


def show(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def console_script(tmp_path: Path) -> list[str]:
    """The installed ``torchmetrics-gradpatch`` script, or one written the way pip and uv write it."""
    installed = shutil.which("torchmetrics-gradpatch", path=str(Path(sys.executable).parent))
    if installed:
        return [sys.executable, installed]
    script = tmp_path / "bin" / "torchmetrics-gradpatch"
    script.parent.mkdir()
    script.write_text(
        "import sys\nfrom torchmetrics_gradpatch.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    return [sys.executable, str(script)]
