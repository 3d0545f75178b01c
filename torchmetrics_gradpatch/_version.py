"""Version gate: whether this torch and torchmetrics are supported, decided before torch or torchmetrics is imported.

Versions come from the installed distributions' metadata, or an imported module's ``__version__`` (what runs), and
are compared with :mod:`packaging` as pip compares them.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.version import InvalidVersion, Version

from torchmetrics_gradpatch._errors import UnsupportedVersionError

#: Upstream documents the graph-preserving gather for PyTorch 2.0 and newer only.
MIN_TORCH = Version("2.0")
#: The oldest torchmetrics the project's test matrix runs; older ones are refused rather than patched untested.
MIN_TORCHMETRICS = Version("0.11")
#: torchmetrics keeps the local rank's graph natively from this release on (upstream PR #2754).
NATIVE_TORCHMETRICS = Version("1.6.0")


def installed_version(distribution: str, module: str | None = None) -> str | None:
    """The version string of ``distribution``, or ``None`` when it is not installed.

    When ``module`` is already imported its ``__version__`` is preferred: that is the code actually running,
    even if the metadata on disk has since changed.
    """
    loaded = sys.modules.get(module or distribution)
    version = getattr(loaded, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse(version: str, what: str) -> Version:
    """Parse ``version`` with :mod:`packaging`, naming ``what`` in the error if it is not a valid version."""
    try:
        return Version(version)
    except InvalidVersion:
        raise UnsupportedVersionError(
            f"torchmetrics_gradpatch cannot parse the installed {what} version {version!r}; "
            f"install a released {what} (see `pip show {what}`)."
        ) from None


#: distribution -> (the oldest release line accepted, why, what to install)
_MINIMA = {
    "torch": (
        MIN_TORCH,
        "The graph-preserving gather it installs (torchmetrics PR #2754) is defined for PyTorch 2.0 and newer",
        "pip install 'torch>=2.0'",
    ),
    "torchmetrics": (
        MIN_TORCHMETRICS,
        "Older torchmetrics are not tested, so they are refused rather than patched untested",
        "pip install 'torchmetrics>=0.11'",
    ),
}


def require(distribution: str, version: str | None) -> Version:
    """Return the parsed version of ``distribution`` ("torch" or "torchmetrics"); raise
    :class:`UnsupportedVersionError` when it is missing or below its minimum.

    The *release* part is compared: ``2.0.0rc1`` and ``2.0.0.dev...`` builds are the 2.0 line and are accepted.
    """
    minimum, why, install = _MINIMA[distribution]
    if version is None:
        raise UnsupportedVersionError(
            f"torchmetrics_gradpatch needs {distribution} >= {minimum}, and {distribution} is not installed: {install}."
        )
    parsed = parse(version, distribution)
    if Version(parsed.base_version) < minimum:
        raise UnsupportedVersionError(
            f"torchmetrics_gradpatch supports {distribution} >= {minimum} only, and {distribution} {version} is "
            f"installed. {why}; nothing was patched. Upgrade ({install}) or do not import torchmetrics_gradpatch."
        )
    return parsed


def is_native(torchmetrics_version: Version) -> bool:
    """Whether this torchmetrics already returns the local rank's tensor, graph and all, from its gather.

    Pre-releases and dev builds of 1.6.0 count as *not* native. That errs on the safe side: patching a
    torchmetrics that already keeps the graph gives the same result, while skipping one that does not would
    silently drop gradients.
    """
    return torchmetrics_version >= NATIVE_TORCHMETRICS
