"""Command line: ``python -m torchmetrics_gradpatch`` and the ``torchmetrics-gradpatch`` console script.

``check [--world-size N] [--timeout S] [--mode local|global] [--sync torchmetrics|fused] [--compile [BACKEND]]``
runs the self-checks of :mod:`.checks` on N gloo ranks on loopback (:mod:`.check`); ``status [--json]`` prints
:func:`torchmetrics_gradpatch.status` after importing torchmetrics. The exit statuses are :mod:`.exit`'s. Nothing
here imports torch or torchmetrics at the top, so ``--help`` and ``--version`` load neither.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
from collections.abc import Sequence

from torchmetrics_gradpatch._errors import UnsupportedVersionError
from torchmetrics_gradpatch.cli.exit import EPILOG, EXIT_OK, PROG, exit_if_cli, refused

__all__ = ["build_parser", "exit_if_cli", "main"]


def _whole(text: str) -> int:
    value = int(text) if text.strip().isdecimal() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, at least 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # refuses nan, inf, 0 and negatives
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def _name(text: str) -> str:
    return text.strip().lower()  # modes and sync strategies are named case-insensitively everywhere


def _backend(name: str) -> str:
    import torch
    import torch._dynamo

    offered = sorted(torch._dynamo.list_backends(exclude_tags=()))  # debug and experimental ones included
    if name not in offered:
        shown = ", ".join(each for each in offered if "TESTING_ONLY" not in each)
        raise argparse.ArgumentTypeError(f"torch {torch.__version__} has no backend {name!r}; choose one of: {shown}")
    return name


def _version() -> str:
    try:  # the metadata's: the package's __init__ imports this module, so it is not imported back
        return importlib.metadata.version("torchmetrics-gradpatch")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Check and report torchmetrics_gradpatch on the installed torch and torchmetrics.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="spawn gloo ranks and verify that gradients flow through the gather and a Metric loss",
        description="Spawn gloo ranks on loopback and verify, against a single-process reference, that gradients "
        "flow through torchmetrics' gather (equal and uneven shapes) and through a Metric used as a loss with "
        "dist_sync_on_step=True (sum and cat states, uneven batches).",
        epilog=EPILOG,
    )
    check.add_argument("--world-size", type=_whole, default=2, metavar="N", help="ranks (default 2)")
    check.add_argument("--timeout", type=_seconds, default=120.0, metavar="S", help="seconds for the run (default 120)")
    check.add_argument(
        "--mode",
        type=_name,
        choices=("local", "global"),
        help="run the checks inside patched(mode=MODE) (default: as imported, TORCHMETRICS_GRADPATCH_MODE)",
    )
    check.add_argument(
        "--sync",
        type=_name,
        choices=("torchmetrics", "fused"),
        help="run the checks inside patched(sync=SYNC) (default: as imported, TORCHMETRICS_GRADPATCH_SYNC)",
    )
    check.add_argument(
        "--compile",
        nargs="?",
        const="eager",
        type=_backend,
        metavar="BACKEND",
        help="run each check's step inside torch.compile(step, backend=BACKEND) (default eager, which compiles in "
        "seconds; inductor or any backend torch offers). On torchmetrics 1.6 and newer it also says whether a "
        "compiled Metric loss needs compile_support()",
    )
    status = commands.add_parser("status", help="print versions, native/patched and where the patch is applied")
    status.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return its exit status."""
    args = build_parser().parse_args(argv)
    try:  # the package recognises torchmetrics' gather when torchmetrics is imported: a refusal comes from here
        import torchmetrics  # noqa: F401
    except UnsupportedVersionError as error:
        return refused(error)
    if args.command == "status":
        from torchmetrics_gradpatch._status import status

        print(status().to_json() if args.json else status())
        return EXIT_OK
    from torchmetrics_gradpatch.cli.check import check

    return check(args)
