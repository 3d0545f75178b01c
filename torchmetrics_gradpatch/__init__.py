"""Keep the autograd graph through torchmetrics' distributed gather, on every torchmetrics from 0.11 on.

``import torchmetrics_gradpatch`` at program start is all most users need: it checks the installed versions and
patches ``torchmetrics.utilities.distributed.gather_all_tensors`` so that the local rank's entry of every synced
metric state keeps its graph (torchmetrics 1.6.0 semantics). The import itself loads neither torch nor
torchmetrics: the patch lands the moment torchmetrics is imported (at once if it already is).

Public names:

* :func:`patch`, :func:`unpatch`, :func:`is_patched` -- switch the patch on and off, and ask whether it is in force;
* :func:`patched` -- ``with patched():`` / ``@patched`` keeps it in force for a block or a call;
  ``patched(mode="global")`` also chooses the gradient mode there, ``patched(sync="fused")`` the sync strategy,
  ``patched(check=True)`` the sync check (each fused sync also runs torchmetrics' own and compares);
* :func:`status` / :class:`Status` -- what is patched, where, and in which gradient mode (also
  ``python -m torchmetrics_gradpatch status``);
* :func:`gather_all_tensors` -- the graph-preserving gather itself, with ``mode="local"`` or ``"global"``;
* :func:`trust` -- let a ``MetricCollection``'s one exchange (the fused sync) take over members of classes of yours,
  after a check-mode run; :func:`explain` -- what that exchange does with each member of a collection, and why;
* :func:`compile_support` -- on torchmetrics 1.6 and newer, install the gather in local mode too, so a Metric loss
  works inside ``torch.compile`` (before 1.6 it works without it; docs/design.md#torchcompile);
* :class:`UnsupportedVersionError`, :class:`GradModeMismatchError`, :class:`FusedSyncError` -- the errors the package
  raises (the last: the ranks' states cannot be synced together by the fused sync, docs/fused-sync.md).

Gradient modes are named case-insensitively everywhere (``"Global"`` is ``"global"``), in the API and in
``TORCHMETRICS_GRADPATCH_MODE`` alike, and so are sync strategies (``TORCHMETRICS_GRADPATCH_SYNC=fused``).
``TORCHMETRICS_GRADPATCH_AUTOPATCH=0`` imports without patching, ``TORCHMETRICS_GRADPATCH_CHECK=1`` turns the sync
check on by default; a value of any of these variables that is not understood makes the import raise a
``ValueError`` naming it.

Documentation: the README and docs/ in the source distribution and repository (docs/api.md: this API and the
fields of ``status()``).

On PyTorch below 2.0, torchmetrics below 0.11, or a torchmetrics whose gather is not recognised, the import raises
:class:`UnsupportedVersionError` and leaves torchmetrics -- and ``sys.modules`` -- exactly as they were. Imported
before torchmetrics, the package recognises the gather when torchmetrics is imported: an unrecognised one makes
``import torchmetrics`` raise that error, with nothing changed; the refusal is kept (``status()`` says why) and every
later ``patch()`` or ``patched()`` raises it again.
"""

from __future__ import annotations

import sys

from torchmetrics_gradpatch._errors import FusedSyncError, GradModeMismatchError, UnsupportedVersionError

__version__ = "0.1.0"

__all__ = [
    "FusedSyncError",
    "GradModeMismatchError",
    "Status",
    "UnsupportedVersionError",
    "compile_support",
    "explain",
    "gather_all_tensors",
    "is_patched",
    "patch",
    "patched",
    "status",
    "trust",
    "unpatch",
]


def _forget_this_package() -> None:
    """Drop this package and its submodules from ``sys.modules`` so a failed import leaves no trace."""
    for name in [n for n in sys.modules if n == __name__ or n.startswith(__name__ + ".")]:
        del sys.modules[name]


# The version gate runs before any module that touches torchmetrics is imported; any failure below (a refused
# version, a bad environment variable) leaves sys.modules and torchmetrics as they were.
try:
    from torchmetrics_gradpatch import _version

    _version.require("torch", _version.installed_version("torch"))
    _tm_version = _version.require("torchmetrics", _version.installed_version("torchmetrics"))

    from torchmetrics_gradpatch import _api, _engine
    from torchmetrics_gradpatch import fused as fused  # registers the "fused" sync strategy with the core
    from torchmetrics_gradpatch._api import compile_support, is_patched, patch, unpatch
    from torchmetrics_gradpatch._blocks import patched
    from torchmetrics_gradpatch._modes import gather_all_tensors
    from torchmetrics_gradpatch._status import Status, status
    from torchmetrics_gradpatch.fused import explain, trust

    _engine.configure(native=_version.is_native(_tm_version), torchmetrics_version=str(_tm_version))
    _api.apply_environment()
except BaseException as _error:
    try:
        # `python -m torchmetrics_gradpatch` and the console script import this package before any CLI code runs;
        # there (only there) a refused version (exit 3) or a bad environment variable (exit 2) is one message.
        from torchmetrics_gradpatch.cli.exit import exit_if_cli

        exit_if_cli(_error)
    finally:
        _forget_this_package()
    raise
