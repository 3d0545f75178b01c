"""``status()``: what is patched, where, in which gradient mode, and why -- for a person debugging a job.

Role: turn the engine's derived view (:func:`torchmetrics_gradpatch._engine.view`, one snapshot taken under the
engine's lock) into :class:`Status`, its JSON and its text; the command line prints the same object.

Invariants: every field comes from that one snapshot (plus the installed versions and the environment), so a
status never contradicts itself; the text says who put the patch in force (the import or ``patch()``) and, on
native torchmetrics in local mode, that nothing is needed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from torchmetrics_gradpatch import _engine
from torchmetrics_gradpatch._api import AUTOPATCH_ENV, MODE_ENV, SYNC_ENV, autopatch_requested
from torchmetrics_gradpatch._target import TARGET_MODULE, TARGET_NAME
from torchmetrics_gradpatch._version import installed_version

__all__ = ["Status", "status"]


@dataclass(frozen=True)
class Status:
    """What a person debugging a cluster job needs to know about the patch in this process.

    ``state`` says in one word what a gather called now runs, and ties the other fields together:

    * ``"patched"``: the patch is in force and this package's gather runs in place of torchmetrics' own;
      ``applied_to`` names where (never empty in this state, and empty in every other);
    * ``"native"``: the patch is in force on a torchmetrics that keeps the graph itself (1.6.0 and newer) in local
      mode: nothing needs applying, torchmetrics' own gather runs and keeps the graph;
    * ``"pending"``: the patch is in force and lands the moment torchmetrics is imported;
    * ``"off"``: the patch is not in force (``unpatch()``, or ``TORCHMETRICS_GRADPATCH_AUTOPATCH=0`` and no
      ``patch()`` since): torchmetrics' own gather runs.
    """

    torch_version: str
    torchmetrics_version: str
    native: bool  #: this torchmetrics keeps the local graph itself (1.6.0+)
    in_force: bool  #: the import's patch or patch() is on, or a patched() block is open (state is not "off")
    graph_preserving: bool  #: a gather called now keeps the local rank's graph
    torchmetrics_imported: bool
    applied_to: tuple[str, ...]  #: where our code is installed: non-empty exactly when state is "patched"
    references: dict[str, bool]  #: known paths into the gather and whether each reaches torchmetrics' own function
    autopatch: bool  #: what TORCHMETRICS_GRADPATCH_AUTOPATCH asked of the import
    mode: str = "local"  #: gradient mode a gather called now uses: "local", "global", or "off" when not in force
    default_mode: str = "local"  #: TORCHMETRICS_GRADPATCH_MODE (or "local"): the mode of patch() without one
    state: str = "off"  #: "patched", "native", "pending" or "off" (see the class docstring)
    manual: bool = False  #: the patch()/unpatch() switch is on (the import turns it on, unpatch() off)
    blocks: int = 0  #: patched() blocks open now
    #: what chose ``mode``: "patched(mode=...)", "patch()", "import" (the import's patch), "default", or "" when off
    mode_from: str = ""
    #: what ``torchmetrics.utilities.distributed.gather_all_tensors`` holds when it is not torchmetrics' own
    #: function (another tool replaced it; torchmetrics' own, which torchmetrics calls, is the one patched), else ""
    attribute: str = ""
    manual_from: str = ""  #: who switched ``manual`` on: "import" or "patch()"; "" while it is off
    #: the sync strategy a Metric sync called now uses: "fused" (two collectives per Metric sync,
    #: docs/fused-sync.md) or "torchmetrics" (its own collectives; also whenever the patch is not in force)
    sync: str = "torchmetrics"
    #: what chose ``sync``: "patched(sync=...)", "patch()", "import", "default", or "" when not in force
    sync_from: str = ""
    default_sync: str = "torchmetrics"  #: TORCHMETRICS_GRADPATCH_SYNC (or "torchmetrics"): the sync of patch()
    fused_installed: bool = False  #: torchmetrics' ``Metric._sync_dist`` is the fused sync's replacement now

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        data = asdict(self)
        data["applied_to"] = list(self.applied_to)
        return data

    def to_json(self) -> str:
        """The status as indented JSON."""
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)

    def _in_force_text(self) -> str:
        if not self.in_force:
            if self.autopatch:
                return "no: unpatch() has switched off the patch the import put in force"
            return f"no: {AUTOPATCH_ENV}=0 kept the import from patching, and patch() has not been called"
        reasons = []
        if self.manual:
            reasons.append("the import patched" if self.manual_from == "import" else "patch() is on")
        if self.blocks:
            reasons.append(f"{self.blocks} patched() block{'s are' if self.blocks > 1 else ' is'} open")
        if self.state == "native":
            return (
                "nothing is needed in local mode (torchmetrics >= 1.6 keeps the graph itself); switched on: "
                + " and ".join(reasons)
            )
        return "yes: " + " and ".join(reasons)

    def _gather_text(self) -> str:
        if self.state == "patched":
            return "patched: torchmetrics_gradpatch's gather runs in place of torchmetrics' own (see applied to)"
        if self.state == "native":
            return "native: torchmetrics keeps the graph itself, so nothing needs applying"
        if self.state == "pending":
            return "patched as soon as torchmetrics is imported"
        own = " (which keeps the graph itself)" if self.native else " (which drops the graph)"
        return "not patched: torchmetrics' own gather runs" + own

    def _mode_text(self) -> str:
        default = f"{self.default_mode} (from {MODE_ENV})" if self.default_mode != "local" else "local"
        if not self.in_force:
            return f"off (not in force); patch() without a mode would use {default}"
        chosen = {
            "patched(mode=...)": "chosen by an open patched(mode=...) block",
            "patch()": "the mode given to patch()",
            "import": "the default mode, which the import patched with",
            "default": "the default mode",
        }.get(self.mode_from, self.mode_from)
        return f"{self.mode}, {chosen}; patch() without a mode uses {default}"

    def _sync_text(self) -> str:
        default = f"{self.default_sync} (from {SYNC_ENV})" if self.default_sync != "torchmetrics" else "torchmetrics"
        if self.sync == "fused":
            where = (
                "Metric._sync_dist is the fused sync"
                if self.fused_installed
                else "installed when torchmetrics is imported"
            )
            chosen = {"patched(sync=...)": "chosen by an open patched(sync=...) block"}.get(self.sync_from, "")
            return f"fused: two collectives per Metric sync ({where}{'; ' + chosen if chosen else ''})"
        own = "torchmetrics: its own collectives per state"
        return own + (f"; patch() without a sync uses {default}" if default != "torchmetrics" else "")

    def __str__(self) -> str:
        lines = [
            f"torch:            {self.torch_version}",
            f"torchmetrics:     {self.torchmetrics_version}",
            f"in force:         {self._in_force_text()}",
            f"gather:           {self._gather_text()}",
            f"graph preserved:  {'yes' if self.graph_preserving else 'NO'}",
            f"gradient mode:    {self._mode_text()}",
            f"sync:             {self._sync_text()}",
            f"at import:        {'patched' if self.autopatch else 'not patched'} ({AUTOPATCH_ENV}"
            f"{'' if self.autopatch else '=0'})",
        ]
        lines += [f"applied to:       {where}" for where in self.applied_to]
        if self.attribute:
            lines.append(
                f"module attribute: {TARGET_MODULE}.{TARGET_NAME} holds {self.attribute}, not torchmetrics' own "
                "function (torchmetrics calls its own, which is the one the patch applies to)"
            )
        if self.state == "patched":  # only then does "reaching the function" mean reaching the patch
            lines += [
                f"reference:        {path}: {'reaches the patched function' if ok else 'DOES NOT reach it'}"
                for path, ok in self.references.items()
            ]
        return "\n".join(lines)


def status() -> Status:
    """Report versions, whether the patch is in force and where it is applied, and whether the graph is kept."""
    view = _engine.view()
    return Status(
        torch_version=installed_version("torch") or "not installed",
        torchmetrics_version=view.torchmetrics_version,
        native=view.native,
        in_force=view.in_force,
        graph_preserving=view.graph_preserved,
        torchmetrics_imported=view.torchmetrics_imported,
        applied_to=view.applied_to,
        references=dict(view.references),
        autopatch=autopatch_requested(),
        mode=view.mode,
        default_mode=view.default_mode,
        state=view.state,
        manual=view.manual,
        blocks=view.blocks,
        mode_from=view.mode_from,
        attribute=view.attribute,
        manual_from=view.manual_from if view.manual else "",
        sync=view.sync,
        sync_from=view.sync_from,
        default_sync=view.default_sync,
        fused_installed=view.fused_installed,
    )
