"""The command line's exit statuses, and a refused import turned into one message (no torch imported here).

0 success; 1 a check failed or did not finish within ``--timeout``; 2 a bad argument or ``TORCHMETRICS_GRADPATCH_*``
variable; 3 cannot run here (versions refused, no loopback port, a rank that failed before the checks). Each is one
message, never a traceback.

Both ways of starting the CLI import the package before any code of the CLI runs (runpy imports it to find
``__main__``; the console script imports ``torchmetrics_gradpatch.cli``), so a refused version or a bad variable is
raised there. The package's ``__init__`` hands that error to :func:`exit_if_cli`, which turns it into one message and
its exit status only when this process *is* the CLI; in any other program the import raises as before.
"""

from __future__ import annotations

import os
import sys

from torchmetrics_gradpatch._errors import UnsupportedVersionError
from torchmetrics_gradpatch._version import installed_version

PROG = "torchmetrics-gradpatch"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CANNOT_RUN = 0, 1, 2, 3
EPILOG = (
    "Exit status: 0 success, 1 a check failed or did not finish within --timeout, 2 usage error (a bad argument or "
    "TORCHMETRICS_GRADPATCH_* variable), 3 cannot run here (unsupported or unrecognised versions, no free loopback "
    "port, or a rank failed before the checks)."
)
_MODULES = ("torchmetrics_gradpatch", "torchmetrics_gradpatch.__main__")
_SCRIPTS = (PROG, f"{PROG}.exe", f"{PROG}-script.py", f"{PROG}-script.pyw")


def launched_as_cli() -> bool:
    """Whether this process was started as this command line: ``python -m`` or the console script."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 != "-m":
        return os.path.basename(argv0) in _SCRIPTS
    # runpy is still importing the package named by -m: it is the interpreter's word just before the program's
    # own arguments, alone ("-m NAME") or glued to its flags ("-mNAME", "-ImNAME")
    word = sys.orig_argv[len(sys.orig_argv) - len(sys.argv)]
    return (word.partition("m")[2] if word.startswith("-") else word) in _MODULES


def refused(error: BaseException) -> int:
    """Print one message for an unsupported torch/torchmetrics pair, naming both versions; return exit status 3."""
    torch_version = installed_version("torch") or "not installed"
    torchmetrics_version = installed_version("torchmetrics") or "not installed"
    print(f"{PROG}: cannot run with torch {torch_version} and torchmetrics {torchmetrics_version}.", file=sys.stderr)
    print(error, file=sys.stderr)
    return EXIT_CANNOT_RUN


def exit_if_cli(error: BaseException) -> None:
    """Called by the package's ``__init__`` when its import fails: in the CLI, one message and its exit status.

    A refused version (:class:`UnsupportedVersionError`) exits 3; a ``ValueError`` naming a
    ``TORCHMETRICS_GRADPATCH_*`` variable (its message says the allowed values) exits 2. Anything else, and any
    error outside the CLI, is left to raise.
    """
    if not launched_as_cli():
        return
    if isinstance(error, UnsupportedVersionError):
        raise SystemExit(refused(error))
    if isinstance(error, ValueError) and str(error).startswith("TORCHMETRICS_GRADPATCH_"):
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
