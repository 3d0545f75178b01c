"""The one derived picture of the patch state: what ``status()`` and the command line print.

Role: :class:`EngineView` says in a few fields what a gather called now runs and why; :func:`derive` computes it
from a copy of the engine's state and what torchmetrics' paths hold, both taken by the engine under its lock, so
a view is one consistent snapshot.

Invariants (checked by the tests in every state):

* ``in_force == (state != "off")`` and ``bool(applied_to) == (state == "patched")``;
* ``state == "patched"`` only when our trampoline *is* torchmetrics' code now **and** the patch is in force (a
  trampoline that another tool put back after ``unpatch()`` runs the original, and is not reported as patched);
* ``graph_preserved``: a gather called now keeps the local rank's graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchmetrics_gradpatch._target import TARGET_MODULE, TARGET_NAME, describe

__all__ = ["EngineView", "derive"]


@dataclass(frozen=True)
class EngineView:
    """The patch state at one moment (see the module docstring for how the fields tie together)."""

    in_force: bool  #: the patch()/unpatch() switch is on or a patched() block is open
    state: str  #: "patched", "native", "pending" or "off" (the Status docstring says what each means)
    mode: str  #: the gradient mode a gather called now uses: "local", "global", or "off" when not in force
    mode_from: str  #: what chose it: "patched(mode=...)", "patch()", "import", "default", or "" when off
    default_mode: str  #: the mode of patch() without one (TORCHMETRICS_GRADPATCH_MODE, else "local")
    manual: bool  #: the patch()/unpatch() switch is on
    manual_from: str  #: who switched it on last: "patch()" or "import"
    blocks: int  #: patched() blocks open
    native: bool  #: this torchmetrics keeps the local graph itself (1.6.0+)
    torchmetrics_version: str
    torchmetrics_imported: bool
    installed: bool  #: our trampoline is torchmetrics' function's code now (in force or not)
    graph_preserved: bool  #: a gather called now keeps the local rank's graph
    applied_to: tuple[str, ...]  #: where our gather runs in place of torchmetrics' own; empty unless "patched"
    references: tuple[tuple[str, bool], ...]  #: each path into the gather and whether it reaches torchmetrics' own
    attribute: str  #: what the module attribute holds when it is not torchmetrics' own function, else ""
    compile_support: bool  #: compile_support() is on
    sync: str  #: the sync strategy a Metric sync called now uses: "torchmetrics" or "fused"
    sync_from: str  #: what chose it: "patched(sync=...)", "patch()", "import", "default", or "" when not in force
    default_sync: str  #: the sync of patch() without one (TORCHMETRICS_GRADPATCH_SYNC, else "torchmetrics")
    fused_installed: bool  #: torchmetrics' Metric._sync_dist is the fused sync's replacement now


def derive(
    state: Any, *, installed: bool, imported: bool, function: Any, held: dict[str, Any], fused_installed: bool = False
) -> EngineView:
    """The view of ``state`` (a copy of the engine's), given what was installed and held at the same moment.

    ``function`` is torchmetrics' own gather (``None`` if torchmetrics is not imported), ``held`` what each
    path into it holds (:func:`torchmetrics_gradpatch._target.held_functions`).
    """
    in_force = bool(state.in_force)
    if in_force and installed and state.gather is not None:
        where = "patched"
    elif not in_force:
        where = "off"
    elif state.native and state.mode == "local":
        where = "native"
    elif not imported:
        where = "pending"
    else:  # in force, torchmetrics imported, our gather not running: the adoption must have failed
        where = "off"
    applied: tuple[str, ...] = ()
    if where == "patched":
        applied = (
            f"{TARGET_MODULE}.{TARGET_NAME}.__code__ (function object at {id(function):#x}; every reference to "
            "that object sees the patch)",
        )
    if state.block_modes:
        mode_from = "patched(mode=...)"
    elif state.manual:
        mode_from = state.manual_from
    else:
        mode_from = "default" if in_force else ""
    if not in_force:
        sync_from = ""
    elif state.block_syncs:
        sync_from = "patched(sync=...)"
    elif state.manual:
        sync_from = state.manual_from
    else:
        sync_from = "default"
    attribute = held.get(f"{TARGET_MODULE}.{TARGET_NAME}", function)
    return EngineView(
        in_force=in_force,
        state=where,
        mode=state.mode if in_force else "off",
        mode_from=mode_from,
        default_mode=state.default_mode,
        manual=bool(state.manual),
        manual_from=state.manual_from,
        blocks=len(state.records),
        native=bool(state.native),
        torchmetrics_version=state.torchmetrics_version,
        torchmetrics_imported=imported,
        installed=installed,
        graph_preserved=bool(state.native) or where in ("patched", "pending"),
        applied_to=applied,
        references=tuple((path, obj is function) for path, obj in held.items()) if function is not None else (),
        attribute="" if function is None or attribute is function else describe(attribute),
        compile_support=bool(state.compile_native),
        sync=state.sync if in_force else "torchmetrics",
        sync_from=sync_from,
        default_sync=state.default_sync,
        fused_installed=fused_installed,
    )
