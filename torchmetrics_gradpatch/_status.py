"""``status()``: what is patched, where, in which gradient mode and sync strategy, with or without the check, and why.

Contract: every field comes from one reading of the engine (:func:`._engine.observe`, under its lock) plus the
installed versions and the environment, so a status never contradicts itself: ``state`` is ``"patched"``,
``"native"`` or ``"pending"`` only while in force, ``"patched"`` only while our trampoline is torchmetrics' code,
``"refused"`` exactly while the patch is asked for and held back; ``applied_to`` and ``sync_applied_to`` together
are everything replaced now. The fields for users: docs/api.md ("Status").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from torchmetrics_gradpatch import _engine, _syncs
from torchmetrics_gradpatch._api import AUTOPATCH_ENV, CHECK_ENV, MODE_ENV, SYNC_ENV, at_import
from torchmetrics_gradpatch._target import TARGET_MODULE, TARGET_NAME, describe
from torchmetrics_gradpatch._version import installed_version

_GATHER = f"{TARGET_MODULE}.{TARGET_NAME}"


@dataclass(frozen=True)
class Status:
    """What a person debugging a cluster job needs to know about the patch in this process.

    ``state`` says in one word what a gather called now runs:

    * ``"patched"``: the patch is in force and this package's gather runs in place of torchmetrics' own;
    * ``"native"``: the patch is in force on a torchmetrics that keeps the graph itself (1.6.0 and newer) in local
      mode: nothing needs applying, torchmetrics' own gather runs and keeps the graph;
    * ``"pending"``: the patch is in force and lands the moment torchmetrics is imported;
    * ``"refused"``: the patch is asked for, but torchmetrics' gather was refused (``refused`` says why), so
      nothing is applied: torchmetrics' own gather and ``Metric._sync_dist`` run;
    * ``"off"``: the patch is not asked for (``unpatch()``, or ``TORCHMETRICS_GRADPATCH_AUTOPATCH=0`` and no
      ``patch()`` since), or another tool's code has replaced this package's: torchmetrics' own gather (or that
      tool's) runs.
    """

    torch_version: str
    torchmetrics_version: str
    state: str  #: "patched", "native", "pending", "refused" or "off" (see above)
    in_force: bool  #: the patch switch is on or a patched() block is open, and not refused
    switched_on_by: str  #: who turned the patch switch on: "import", "patch()", or "" while it is off
    open_blocks: int  #: patched() blocks open now
    graph_preserving: bool  #: a gather called now keeps the local rank's graph
    native: bool  #: this torchmetrics keeps the local rank's graph itself (1.6.0 and newer)
    mode: str  #: the gradient mode a gather called now uses: "local", "global", or "off" when not in force
    #: what chose ``mode``: "patched(mode=...)", "patch()", "import", "default", or "" when not in force
    mode_chosen_by: str
    default_mode: str  #: the mode of patch() without one: TORCHMETRICS_GRADPATCH_MODE, else "local"
    sync: str  #: the sync strategy a Metric sync called now uses: "torchmetrics" or "fused"
    #: what chose ``sync``: "patched(sync=...)", "patch()", "import", "default", or "" when not in force
    sync_chosen_by: str
    default_sync: str  #: the sync of patch() without one: TORCHMETRICS_GRADPATCH_SYNC, else "torchmetrics"
    #: the sync check is on: a fused sync called now also runs torchmetrics' own sync on the same states and
    #: compares (False when not in force); it checks the fused sync only, so with ``sync == "torchmetrics"`` it is
    #: idle and nothing is checked (the text says so)
    check: bool
    #: what chose ``check``: "patched(check=...)", "patch()", "import", "default", or "" when not in force
    check_chosen_by: str
    default_check: bool  #: the check of patch() without one: TORCHMETRICS_GRADPATCH_CHECK, else False
    compile_support: bool  #: compile_support() is on (matters on torchmetrics >= 1.6 only)
    torchmetrics_imported: bool
    #: where this package's gather runs in place of torchmetrics' own: non-empty exactly when state is "patched"
    applied_to: tuple[str, ...]
    #: the other places replaced now: ``torchmetrics.Metric._sync_dist`` (the sync strategy, behind one graph break
    #: under torch.compile) and any site of the strategy in force
    sync_applied_to: tuple[str, ...]
    #: what the fused sync does not recognise in the modules it recognises whole (a module whose source is no known
    #: release's, or a binding in one: ``torchmetrics.metric.dim_zero_cat``), each with the parts of the fused sync
    #: that step aside for it, where torchmetrics' own path runs; empty when all is recognised or torchmetrics is not
    #: imported
    stepped_aside: dict[str, tuple[str, ...]]
    #: the classes of yours named with ``trust()``: a collection's one exchange takes over members of these classes
    #: besides torchmetrics' own (docs/fused-sync.md)
    trusted: tuple[str, ...]
    #: every path torchmetrics uses to reach its gather, and whether it reaches torchmetrics' own function
    references: dict[str, bool]
    #: what another tool put in the module attribute ``torchmetrics.utilities.distributed.gather_all_tensors``
    #: (torchmetrics calls its own function, which is the one patched), or None when it holds torchmetrics' own
    attribute_replaced_by: str | None
    autopatch: bool  #: the import switched the patch on (TORCHMETRICS_GRADPATCH_AUTOPATCH unset, or true)
    #: the value of TORCHMETRICS_GRADPATCH_AUTOPATCH the import read, or None when it was unset or blank
    autopatch_variable: str | None
    #: while the switch is off: who had switched it on before unpatch() switched it off ("import" or "patch()"),
    #: or "" when it has never been on
    switched_off_from: str
    #: why torchmetrics' gather was refused (the UnsupportedVersionError message patch() and patched() raise), or
    #: None; set once, never cleared
    refused: str | None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        data = asdict(self)
        data["applied_to"] = list(self.applied_to)
        data["sync_applied_to"] = list(self.sync_applied_to)
        data["stepped_aside"] = {function: list(parts) for function, parts in self.stepped_aside.items()}
        data["trusted"] = list(self.trusted)
        return data

    def to_json(self) -> str:
        """The status as indented JSON."""
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)

    def _asked_by(self) -> list[str]:
        reasons = []
        if self.switched_on_by:
            reasons.append("the import patched" if self.switched_on_by == "import" else "patch() is on")
        if self.open_blocks:
            reasons.append(f"{self.open_blocks} patched() block{'s are' if self.open_blocks > 1 else ' is'} open")
        return reasons

    def _in_force_text(self) -> str:
        if self.state == "refused":
            asked = ["the import" if self.switched_on_by == "import" else "patch()"] if self.switched_on_by else []
            if self.open_blocks:
                asked.append(f"{self.open_blocks} open patched() block{'s' if self.open_blocks > 1 else ''}")
            by = " and ".join(asked)
            return f"no: asked for by {by}, but torchmetrics was refused (see refused): nothing is applied"
        if not self.in_force:
            if self.switched_off_from:
                by = "the import" if self.switched_off_from == "import" else "patch()"
                text = f"no: unpatch() has switched off the patch {by} switched on"
            elif self.autopatch_variable is not None and not self.autopatch:
                text = f"no: {AUTOPATCH_ENV}={self.autopatch_variable} kept the import from patching"
                text += ", and patch() has not switched it on since"
            else:
                text = "no: nothing has switched the patch on"
            return text + ("; torchmetrics was refused (see refused)" if self.refused is not None else "")
        reasons = self._asked_by()
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
        }.get(self.mode_chosen_by, self.mode_chosen_by)
        return f"{self.mode}, {chosen}; patch() without a mode uses {default}"

    def _sync_text(self) -> str:
        default = f"{self.default_sync} (from {SYNC_ENV})" if self.default_sync != "torchmetrics" else "torchmetrics"
        if self.sync == "fused":
            chosen = (
                " (chosen by an open patched(sync=...) block)" if self.sync_chosen_by == "patched(sync=...)" else ""
            )
            return (
                "fused: one exchange per Metric sync and per MetricCollection (one collective when steady, two after "
                f"a change){chosen}"
            )
        own = "torchmetrics: its own collectives per state"
        return own + (f"; patch() without a sync uses {default}" if default != "torchmetrics" else "")

    def _check_text(self) -> str:
        if not self.check:
            return "off" + (f"; patch() without check= uses on (from {CHECK_ENV})" if self.default_check else "")
        chosen = " (chosen by an open patched(check=...) block)" if self.check_chosen_by == "patched(check=...)" else ""
        if self.sync != "fused":
            return f"on{chosen}, idle: only the fused sync is checked, and torchmetrics' own sync runs"
        return (
            f"on{chosen}: each fused sync also runs torchmetrics' own sync on the same states and compares bit for bit"
        )

    def _import_text(self) -> str:
        done = "switched the patch on" if self.autopatch else "left the patch off"
        why = "the default" if self.autopatch_variable is None else f"{AUTOPATCH_ENV}={self.autopatch_variable}"
        return f"{done} ({why})"

    def __str__(self) -> str:
        lines = [
            f"torch:            {self.torch_version}",
            f"torchmetrics:     {self.torchmetrics_version}",
            f"in force:         {self._in_force_text()}",
            f"gather:           {self._gather_text()}",
            f"graph preserved:  {'yes' if self.graph_preserving else 'NO'}",
            f"gradient mode:    {self._mode_text()}",
            f"sync:             {self._sync_text()}",
            f"sync check:       {self._check_text()}",
            f"at import:        {self._import_text()}",
        ]
        if self.refused is not None:
            lines.append(f"refused:          {self.refused}")
        lines += [f"applied to:       {where}" for where in (*self.applied_to, *self.sync_applied_to)]
        lines += [
            f"steps aside:      {function} is not recognised: torchmetrics' own path runs for {', '.join(parts)}"
            for function, parts in self.stepped_aside.items()
        ]
        lines += [f"trusted:          {name} (trust())" for name in self.trusted]
        if self.attribute_replaced_by is not None:
            lines.append(
                f"module attribute: {_GATHER} holds {self.attribute_replaced_by}, not torchmetrics' own function "
                "(torchmetrics calls its own, which is the one the patch applies to)"
            )
        if self.state == "patched":  # only then does "reaching the function" mean reaching the patch
            lines += [
                f"reference:        {path}: {'reaches the patched function' if ok else 'DOES NOT reach it'}"
                for path, ok in self.references.items()
            ]
        return "\n".join(lines)


def _sync_dist_text(sync: str) -> str:
    """``Metric._sync_dist`` as ``applied to`` lists it: which sync it runs and why it is replaced."""
    if sync == "torchmetrics":
        why = (
            "torchmetrics' own method, replaced along with the gather so that under torch.compile the whole sync "
            "runs eagerly behind one graph break"
        )
    else:
        why = "replaced because that sync strategy is chosen; one graph break under torch.compile"
    return f"torchmetrics.Metric._sync_dist (runs the {sync!r} sync: {why})"


def _chosen_by(in_force: bool, blocks_chose: bool, block: str, switched_on_by: str) -> str:
    if not in_force:
        return ""
    if blocks_chose:
        return block
    return switched_on_by or "default"


def status() -> Status:
    """Report versions, whether the patch is in force, everything it has replaced, and whether the graph is kept."""
    seen = _engine.observe()
    state, function = seen.state, seen.function
    in_force = bool(state.in_force)
    if in_force and seen.installed and state.gather is not None:
        where = "patched"
    elif in_force and state.native and state.mode == "local":
        where = "native"
    elif in_force and not seen.imported:
        where = "pending"
    elif state.held_back:
        where = "refused"
    else:  # not in force, or in force with torchmetrics imported and our gather not running: adoption failed
        where = "off"
    applied: tuple[str, ...] = ()
    if where == "patched":
        applied = (f"{_GATHER}.__code__ (function object at {id(function):#x}; every reference to it sees the patch)",)
    sync_applied: tuple[str, ...] = ()
    if seen.sync_dist is not None:
        sync_applied = (_sync_dist_text(seen.sync_dist), *seen.sites)
    switched_on_by = state.manual_from if state.manual else ""
    choice = at_import()
    attribute = seen.held.get(_GATHER, function)
    return Status(
        torch_version=installed_version("torch") or "not installed",
        torchmetrics_version=state.torchmetrics_version,
        state=where,
        in_force=in_force,
        switched_on_by=switched_on_by,
        open_blocks=len(state.records),
        graph_preserving=bool(state.native) or where in ("patched", "pending"),
        native=bool(state.native),
        mode=state.mode if in_force else "off",
        mode_chosen_by=_chosen_by(in_force, bool(state.block_modes), "patched(mode=...)", switched_on_by),
        default_mode=state.default_mode,
        sync=state.sync if in_force else "torchmetrics",
        sync_chosen_by=_chosen_by(in_force, bool(state.block_syncs), "patched(sync=...)", switched_on_by),
        default_sync=state.default_sync,
        check=bool(state.checking),
        check_chosen_by=_chosen_by(in_force, bool(state.block_checks), "patched(check=...)", switched_on_by),
        default_check=bool(state.default_check),
        compile_support=bool(state.compile_native),
        torchmetrics_imported=seen.imported,
        applied_to=applied,
        sync_applied_to=sync_applied,
        stepped_aside=_syncs.stepped_aside(),
        trusted=_syncs.trusted(),
        references={path: obj is function for path, obj in seen.held.items()} if function is not None else {},
        attribute_replaced_by=None if function is None or attribute is function else describe(attribute),
        autopatch=choice.patched,
        autopatch_variable=choice.variable,
        switched_off_from="" if state.manual else state.manual_from,
        refused=state.refusal,
    )
