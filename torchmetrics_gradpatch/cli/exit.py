"""The command line's exit contract, and the refusal it turns into one message (no torch imported here).

Exit statuses (``EXIT_*``; the parser's epilog says them to users): 0 success; 1 a check failed or did not finish
within ``--timeout``; 2 a usage error -- a bad argument or a bad ``TORCHMETRICS_GRADPATCH_*`` variable, one message
naming it and its allowed values; 3 cannot run here -- an unsupported or unrecognised torch/torchmetrics, a
loopback port the ranks cannot listen on, a rank that could not start. Never a traceback for any of these.

Both ways of starting the CLI import the package first (runpy imports it to find ``__main__``; the console script
imports ``torchmetrics_gradpatch.cli``), so a refusal of the versions or a bad environment variable is raised
before any code of the CLI runs. The package's ``__init__`` hands that error to :func:`exit_if_cli`, which asks
whether this process *is* the CLI (``sys.argv[0]`` is ``"-m"`` while runpy locates the module named in
``sys.orig_argv``, or the console script's name) and, only then, turns it into one message and its exit status;
in every other program the import raises as before. Hence this module imports only the standard library and
:mod:`torchmetrics_gradpatch._version`, which imports neither torch nor torchmetrics.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from torchmetrics_gradpatch._errors import UnsupportedVersionError
from torchmetrics_gradpatch._version import installed_version

PROG = "torchmetrics-gradpatch"
PACKAGE = "torchmetrics_gradpatch"

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # a check failed, or the run did not finish within --timeout
EXIT_USAGE = 2  # argparse's own; also a bad TORCHMETRICS_GRADPATCH_* variable
EXIT_CANNOT_RUN = 3  # only "cannot run here": versions refused, no loopback port, a rank that could not start
EPILOG = (
    "Exit status: 0 success, 1 a check failed or did not finish within --timeout, 2 usage error (a bad argument or "
    "TORCHMETRICS_GRADPATCH_* variable), 3 cannot run here (unsupported or unrecognised versions, no free loopback "
    "port, or a rank could not start)."
)
#: Environment variables the package reads at import; a ValueError naming one of them is a usage error.
_ENV_PREFIX = "TORCHMETRICS_GRADPATCH_"

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


def usage_error(message: str, command: str = "") -> int:
    """Print ``message`` as argparse prints its errors (``prog [command]: error: ...``); return exit status 2."""
    print(f"{PROG}{' ' + command if command else ''}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def exit_if_cli(error: BaseException) -> None:
    """Called by ``__init__`` when its import fails: in the CLI, one message and the exit status it means.

    An unsupported torch/torchmetrics (:class:`UnsupportedVersionError`) exits 3; a ``ValueError`` naming one of
    the package's ``TORCHMETRICS_GRADPATCH_*`` variables (its message says the allowed values) exits 2. Anything
    else, and any error outside the CLI, is left to raise.
    """
    if not launched_as_cli():
        return
    if isinstance(error, UnsupportedVersionError):
        print(refusal_message(error), file=sys.stderr)
        raise SystemExit(EXIT_CANNOT_RUN)
    if isinstance(error, ValueError) and str(error).startswith(_ENV_PREFIX):
        raise SystemExit(usage_error(str(error)))


def torchmetrics_refused() -> bool:
    """Import torchmetrics (the package is imported already); if it is not recognised, print the refusal.

    The package recognises torchmetrics' gather when ``torchmetrics.utilities.distributed`` is imported (its
    post-import hook), so an unrecognised torchmetrics fails *this* import, not the package's.
    """
    try:
        import torchmetrics  # noqa: F401
    except UnsupportedVersionError as err:
        print(refusal_message(err), file=sys.stderr)
        return True
    return False
