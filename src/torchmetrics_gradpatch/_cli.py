"""Command line: ``python -m torchmetrics_gradpatch`` and the ``torchmetrics-gradpatch`` console script.

``check [--world-size N] [--timeout S] [--mode local|global] [--compile [BACKEND]]``
    Spawns N gloo ranks on loopback (:func:`torchmetrics_gradpatch.testing.spawn_ranks`), runs the checks of
    :mod:`torchmetrics_gradpatch._checks` on the installed torch and torchmetrics, compares every rank's
    gradients with a single-process reference computed here, and prints a table. Exit status 0 when every
    check passes, 1 when one fails.
``status [--json]``
    Prints :func:`torchmetrics_gradpatch.status` after importing torchmetrics.

Both commands import torchmetrics after the package. Where the package does not recognise torchmetrics' gather
(a torchmetrics it does not know, before 1.6; or, with ``TORCHMETRICS_GRADPATCH_MODE=global``, any), that
import raises :class:`~torchmetrics_gradpatch.UnsupportedVersionError`: both print one message and exit 3.

Refusing unsupported versions without a traceback
-------------------------------------------------
Both ways of starting the CLI import the package first: ``python -m torchmetrics_gradpatch`` (runpy imports
the package to find ``__main__``) and the console script (``from torchmetrics_gradpatch._cli import main``).
On torch below 2.0 that import raises :class:`~torchmetrics_gradpatch.UnsupportedVersionError` by design,
before any code of the CLI runs. So the package's ``__init__`` asks :func:`exit_if_cli`, on that error only,
whether this process *is* the CLI -- ``sys.argv[0]`` is ``"-m"`` while runpy locates the module named in
``sys.orig_argv``, and the console script's name while the script imports its entry point. If so, the
refusal becomes one message on stderr and exit status 3; in every other program the import raises as before.
This module therefore imports only the standard library and :mod:`torchmetrics_gradpatch._version` (which
imports neither torch nor torchmetrics) at the top; everything else is imported inside the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from torchmetrics_gradpatch._version import installed_version

PROG = "torchmetrics-gradpatch"
PACKAGE = "torchmetrics_gradpatch"

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2  # argparse's own
EXIT_CANNOT_RUN = 3  # unsupported versions, or the ranks could not run the checks

_CLI_MODULES = {PACKAGE, f"{PACKAGE}.__main__"}
_CLI_SCRIPTS = {PROG, f"{PROG}.exe", f"{PROG}-script.py", f"{PROG}-script.pyw"}


def _module_target(orig_argv: Sequence[str]) -> str | None:
    """The module named by ``-m`` in the interpreter's own command line, or ``None`` (CPython's option rules)."""
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":
            next(args, None)
            continue
        if not arg.startswith("-") or arg in ("-", "--"):
            return None  # a script, stdin, or the end of the options: not -m
        if arg.startswith("--"):
            continue
        for index, flag in enumerate(arg[1:], start=1):
            rest = arg[index + 1 :]
            if flag == "m":
                return rest or next(args, None)
            if flag == "c":
                return None
            if flag in "WX":  # takes an argument, attached or as the next word
                if not rest:
                    next(args, None)
                break
    return None


def launched_as_cli() -> bool:
    """Whether this process was started as this package's command line (either way of starting it)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 == "-m":  # runpy is still locating the module given to -m
        return _module_target(getattr(sys, "orig_argv", ())) in _CLI_MODULES
    return os.path.basename(argv0) in _CLI_SCRIPTS


def refusal_message(error: BaseException) -> str:
    """One message for an unsupported torch/torchmetrics pair, naming both installed versions."""
    torch_version = installed_version("torch") or "not installed"
    torchmetrics_version = installed_version("torchmetrics") or "not installed"
    return f"{PROG}: cannot run with torch {torch_version} and torchmetrics {torchmetrics_version}.\n{error}"


def exit_if_cli(error: BaseException) -> None:
    """Called by ``__init__`` on :class:`UnsupportedVersionError`: in the CLI, print the refusal and exit 3."""
    if launched_as_cli():
        print(refusal_message(error), file=sys.stderr)
        raise SystemExit(EXIT_CANNOT_RUN)


# --- commands -------------------------------------------------------------------------------------------------


def _torchmetrics_refused() -> bool:
    """Import torchmetrics (the package is imported already); if it is not recognised, print the refusal.

    The package recognises torchmetrics' gather when ``torchmetrics.utilities.distributed`` is imported (its
    post-import hook), so an unrecognised torchmetrics fails *this* import, not the package's.
    """
    from torchmetrics_gradpatch import UnsupportedVersionError

    try:
        import torchmetrics  # noqa: F401
    except UnsupportedVersionError as err:
        print(refusal_message(err), file=sys.stderr)
        return True
    return False


def _status(args: argparse.Namespace) -> int:
    if _torchmetrics_refused():  # imported so the status shows where the patch is applied, not "when imported"
        return EXIT_CANNOT_RUN

    from torchmetrics_gradpatch import status

    current = status()
    print(current.to_json() if args.json else current)
    return EXIT_OK


class _Progress:
    """A progress line on stderr while the ranks start and run (they take seconds to import torch)."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._done = threading.Event()
        self._start = time.monotonic()
        self._live = sys.stderr.isatty()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self._done.wait(0.5):
            sys.stderr.write(f"\r{self._text} {time.monotonic() - self._start:.0f} s")
            sys.stderr.flush()

    def __enter__(self) -> _Progress:
        sys.stderr.write(f"{self._text}" + ("" if self._live else "\n"))
        sys.stderr.flush()
        if self._live:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._done.set()
        seconds = time.monotonic() - self._start
        if self._live:
            self._thread.join()
            outcome = "done in" if exc_type is None else "FAILED after"
            sys.stderr.write(f"\r{self._text} {outcome} {seconds:.1f} s\n")
        else:
            outcome = "ranks finished in" if exc_type is None else "ranks FAILED after"
            sys.stderr.write(f"{outcome} {seconds:.1f} s\n")
        sys.stderr.flush()


def _mode(state: dict[str, Any]) -> str:
    if state["applied_to"]:  # installed: any mode on torchmetrics < 1.6, global mode on native ones too
        return "patched (torchmetrics_gradpatch's gather is in force)"
    if state["native"]:
        return "native (this torchmetrics keeps the graph itself; nothing patched)"
    if state["graph_preserving"]:
        return "patched (torchmetrics_gradpatch's gather is in force)"
    return "NOT patched (TORCHMETRICS_GRADPATCH_AUTOPATCH=0 or unpatch()): torchmetrics' own gather"


def _gradient_mode(state: dict[str, Any], world_size: int) -> str:
    mode = state.get("mode", "local")
    if mode == "global":
        return f"global (each rank receives every rank's loss gradient: {world_size} x the local-mode reference)"
    if mode == "off" and not state["native"]:
        return "off"
    return "local (each rank backpropagates through its own entry: torchmetrics 1.6 semantics)"


def _rows(table: Iterator[tuple[str, str, str]]) -> list[str]:
    return [f"  {check:<44} {result:<6} {seconds:>9}" for check, result, seconds in table]


def _check(args: argparse.Namespace) -> int:
    if _torchmetrics_refused():  # before the ranks start: each would refuse the same way, slower
        return EXIT_CANNOT_RUN

    from torchmetrics_gradpatch import _checks
    from torchmetrics_gradpatch.testing import RankError, spawn_ranks

    world_size: int = args.world_size
    text = f"starting {world_size} gloo rank{'s' if world_size > 1 else ''} on loopback (each imports torch)..."
    try:
        with _Progress(text):
            results = spawn_ranks(_checks.rank_main, world_size, args=(args.mode, args.compile), timeout=args.timeout)
    except RankError as err:
        print(f"{PROG}: the checks could not run: {err}", file=sys.stderr)
        return EXIT_CANNOT_RUN

    state = results[0][0]
    lines = [
        f"torchmetrics-gradpatch check, {world_size} rank{'s' if world_size > 1 else ''} (gloo, loopback)",
        f"  torch         {state['torch_version']}",
        f"  torchmetrics  {state['torchmetrics_version']}",
        f"  gather        {_mode(state)}",
        f"  gradient mode {_gradient_mode(state, world_size)}",
        *([f"  compiled      torch.compile(step, backend={args.compile!r})"] if args.compile else []),  # --compile
        "",
    ]
    failures: list[str] = []
    table = [("check", "result", "time")]
    for name, title in _checks.CHECKS.items():
        passed = True
        for rank, (_, outcomes) in enumerate(results):
            outcome = outcomes[name]
            if outcome.error is not None:
                failures.append(f"  {title}, rank {rank}: {outcome.error.splitlines()[-1]}")
                passed = False
                break
            reference = _checks.reference(name, rank, world_size, state.get("mode", "local"))
            if not _checks.matches(outcome.grads, reference):
                failures.append(f"  {title}, rank {rank}: gradient differs from the single-process reference")
                passed = False
                break
        seconds = max(outcomes[name].seconds for _, outcomes in results)
        table.append((title, "pass" if passed else "FAIL", f"{seconds * 1000:.1f} ms"))
    lines += _rows(iter(table))
    passed_count = len(_checks.CHECKS) - len(failures)
    lines.append("")
    if not failures:
        lines.append(f"all {passed_count} checks passed: every rank's gradient matches the single-process reference")
    else:
        lines.append(f"{len(failures)} of {len(_checks.CHECKS)} checks FAILED:")
        lines += failures
        if not state["graph_preserving"]:
            lines.append(
                f"torchmetrics {state['torchmetrics_version']} drops the autograd graph in its gather; this is what "
                "the patch fixes (run without TORCHMETRICS_GRADPATCH_AUTOPATCH=0)."
            )
    print("\n".join(lines))
    return EXIT_OK if not failures else EXIT_CHECK_FAILED


# --- entry point --------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Check and report torchmetrics_gradpatch on the installed torch and torchmetrics.",
        epilog="Exit status: 0 success, 1 a check failed, 2 usage error, 3 cannot run here (unsupported "
        "versions, or the ranks failed to start).",
    )
    from torchmetrics_gradpatch import __version__  # the package is imported already (see the module docstring)

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="spawn gloo ranks and verify that gradients flow through the gather and a Metric loss",
        description="Spawn gloo ranks on loopback and verify, against a single-process reference, that "
        "gradients flow through torchmetrics' gather (equal and uneven shapes) and through a Metric used as a "
        "loss with dist_sync_on_step=True (sum and cat states).",
    )
    check.add_argument("--world-size", type=_positive_int, default=2, metavar="N", help="ranks (default 2)")
    check.add_argument(
        "--timeout", type=_positive_float, default=120.0, metavar="S", help="seconds for the whole run (default 120)"
    )
    check.add_argument(
        "--mode",
        type=lambda text: text.strip().lower(),  # the package's one rule for mode names: case-insensitive
        choices=("local", "global"),
        default=None,
        help="run the checks inside patched(mode=MODE) (default: as imported, TORCHMETRICS_GRADPATCH_MODE)",
    )
    check.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="run each check's step inside torch.compile(step, backend=BACKEND) (default BACKEND: inductor, "
        "torch's own default; eager and aot_eager compile faster)",
    )
    check.set_defaults(run=_check)
    status = commands.add_parser("status", help="print versions, native/patched and where the patch is applied")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(run=_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.run(args))


def run() -> NoReturn:
    """``python -m torchmetrics_gradpatch``."""
    sys.exit(main())
