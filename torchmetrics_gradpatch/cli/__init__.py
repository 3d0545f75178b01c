"""Command line: ``python -m torchmetrics_gradpatch`` and the ``torchmetrics-gradpatch`` console script.

``check [--world-size N] [--timeout S] [--mode local|global] [--sync torchmetrics|fused] [--compile [BACKEND]]``
    Spawns N gloo ranks on loopback, runs the checks of :mod:`torchmetrics_gradpatch.cli.checks` on the installed
    torch and torchmetrics and compares every rank's gradients with a single-process reference
    (:mod:`torchmetrics_gradpatch.cli.check`).
``status [--json]``
    Prints :func:`torchmetrics_gradpatch.status` after importing torchmetrics.

The exit statuses, and how a refused import becomes one message, are :mod:`torchmetrics_gradpatch.cli.exit`'s.
Nothing here imports torch or torchmetrics at the top, so ``--version`` and ``--help`` load neither.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from torchmetrics_gradpatch.cli import check as _cli_check
from torchmetrics_gradpatch.cli.exit import (
    EPILOG,
    EXIT_CANNOT_RUN,
    EXIT_OK,
    PROG,
    exit_if_cli,
    launched_as_cli,
    torchmetrics_refused,
)

__all__ = ["build_parser", "exit_if_cli", "launched_as_cli", "main", "run"]


def _status_text(snapshot: Any, *, as_json: bool) -> str:
    """What ``status`` prints, from one snapshot of the patch's state (:class:`torchmetrics_gradpatch.Status`)."""
    return str(snapshot.to_json() if as_json else snapshot)


def _status(args: argparse.Namespace) -> int:
    if torchmetrics_refused():  # imported so the status shows where the patch is applied, not "when imported"
        return EXIT_CANNOT_RUN

    from torchmetrics_gradpatch._status import status  # after the gate above: this import loads the engine

    print(_status_text(status(), as_json=args.json))
    return EXIT_OK


# --- entry point --------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, at least 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # refuses nan, inf, 0 and negatives; the harness waits for any finite time
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def _package_version() -> str:
    # The installed metadata's version (the package's __init__ imports this module, so it is not imported back)
    try:
        return importlib.metadata.version("torchmetrics-gradpatch")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Check and report torchmetrics_gradpatch on the installed torch and torchmetrics.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="spawn gloo ranks and verify that gradients flow through the gather and a Metric loss",
        description="Spawn gloo ranks on loopback and verify, against a single-process reference, that "
        "gradients flow through torchmetrics' gather (equal and uneven shapes) and through a Metric used as a "
        "loss with dist_sync_on_step=True (sum and cat states).",
        epilog=EPILOG,
    )
    check.add_argument("--world-size", type=_positive_int, default=2, metavar="N", help="ranks (default 2)")
    check.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        metavar="S",
        help="seconds for the whole run, any positive finite number (default 120)",
    )
    check.add_argument(
        "--mode",
        type=lambda text: text.strip().lower(),  # the package's one rule for mode names: case-insensitive
        choices=("local", "global"),
        default=None,
        help="run the checks inside patched(mode=MODE) (default: as imported, TORCHMETRICS_GRADPATCH_MODE)",
    )
    check.add_argument(
        "--sync",
        type=lambda text: text.strip().lower(),  # sync names follow the mode names' rule: case-insensitive
        choices=("torchmetrics", "fused"),
        default=None,
        help="run the checks inside patched(sync=SYNC) (default: as imported, TORCHMETRICS_GRADPATCH_SYNC)",
    )
    check.add_argument(
        "--compile",
        nargs="?",
        const="eager",
        default=None,
        metavar="BACKEND",
        help="run each check's step inside torch.compile(step, backend=BACKEND), as your program would (BACKEND: "
        "default eager, which compiles in seconds; name inductor or any backend torch offers). On torchmetrics "
        "1.6 and newer it also says whether a compiled Metric loss needs compile_support()",
    )
    check.set_defaults(run=_cli_check.run)
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
