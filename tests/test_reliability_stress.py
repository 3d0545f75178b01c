"""Stress: thousands of patch()/unpatch()/patched() calls from 8 threads while ranks keep gathering.

Each rank starts from torchmetrics as shipped (``TORCHMETRICS_GRADPATCH_AUTOPATCH=0``), records the exact
original state (the gather's ``__code__`` object, its ``__dict__`` and defaults, both torchmetrics module
namespaces, ``Metric._sync_dist``'s default), then toggles from 8 threads while the main thread gathers --
inside ``patched()`` blocks, where the graph must never be lost, and outside them, where the values must be
right whichever state the other threads left. At the end, after ``unpatch()``, the state must be the original,
object for object. Each test runs on fresh ranks (``run_ranks(..., fresh=True)``) and checks every rank's result.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchmetrics_gradpatch as tmgp
from tests._profile import sized
from tests._ranks import run_ranks

pytestmark = pytest.mark.system

NATIVE = tmgp.status().native


def _original_state() -> dict[str, Any]:
    import torchmetrics.metric as metric_module
    import torchmetrics.utilities.distributed as distributed

    function = distributed.gather_all_tensors
    return {
        "code": function.__code__,
        "dict": dict(function.__dict__),
        "defaults": function.__defaults__,
        "distributed": dict(vars(distributed)),
        "metric": dict(vars(metric_module)),
        "sync_dist_defaults": metric_module.Metric._sync_dist.__defaults__,
    }


def _state_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    if after["code"] is not before["code"]:
        out.append(f"__code__ is {after['code']!r}, not the original {before['code']!r}")
    if after["dict"] != before["dict"]:
        out.append(f"__dict__ changed: {before['dict']!r} -> {after['dict']!r}")
    if after["defaults"] != before["defaults"]:
        out.append("__defaults__ changed")
    from torchmetrics_gradpatch import _engine

    for module in ("distributed", "metric"):
        # Python's warnings machinery adds __warningregistry__ when torchmetrics' own gather warns; not ours. The
        # engine adds one private name to torchmetrics' distributed module when it first installs the trampoline
        # (the trampoline finds the dispatch through it) and leaves it there; it must be the dispatch itself.
        allowed = {"__warningregistry__"}
        if module == "distributed" and after[module].get(_engine.DISPATCH_NAME) is _engine.dispatch:
            allowed.add(_engine.DISPATCH_NAME)
        changed = (set(after[module]) ^ set(before[module])) - allowed
        if changed:
            out.append(f"{module} namespace keys changed: {changed}")
        for name, value in before[module].items():
            if name in after[module] and after[module][name] is not value:
                out.append(f"{module}.{name} was replaced")
    if after["sync_dist_defaults"] != before["sync_dist_defaults"] or any(
        a is not b for a, b in zip(after["sync_dist_defaults"], before["sync_dist_defaults"], strict=True)
    ):
        out.append("Metric._sync_dist.__defaults__ changed")
    return out


def run_stress(gathers: int, min_ops: int, threads: int = 8, mode: str = "local") -> dict[str, Any]:
    """Toggle from ``threads`` threads (at least ``min_ops`` calls in all) while gathering ``gathers`` times.

    Needs ``TORCHMETRICS_GRADPATCH_AUTOPATCH=0`` in the environment, so the state seen first is torchmetrics'
    own. The main thread issues exactly ``gathers`` gathers on every rank (the collectives stay in lockstep);
    the toggling threads issue none.

    ``mode="global"``: the threads toggle ``patch("global")`` and ``patched(mode="global")``, which install the
    trampoline on every torchmetrics (local mode installs nothing on native torchmetrics). The global mode's
    collectives differ from the unpatched gather's, and each rank's threads toggle on their own, so then each
    rank gathers over a group of its own (one rank): the patch state can never differ across a group.
    """
    from torchmetrics_gradpatch import _engine

    assert not tmgp.is_patched(), "run_stress expects TORCHMETRICS_GRADPATCH_AUTOPATCH=0"
    before = _original_state()
    rank = dist.get_rank()
    stop = threading.Event()
    errors: list[str] = []
    ops = [0] * threads
    installed_seen = [0] * threads  # blocks that saw the trampoline installed: the toggling really swapped code
    world = dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates every group, in order
    group = solo[rank] if mode == "global" else None
    members = [rank] if mode == "global" else list(range(world))
    index = members.index(rank)

    def toggler(t: int) -> None:
        rng = random.Random(rank * 1000 + t)
        try:
            while not stop.is_set() or sum(ops) < min_ops:
                choice = rng.randrange(5)
                if choice == 0:
                    tmgp.patch(mode)
                elif choice == 1:
                    tmgp.unpatch()
                elif choice == 2:
                    with tmgp.patched(mode=mode):
                        if not tmgp.is_patched():
                            errors.append("is_patched() False inside a block")
                        installed_seen[t] += _engine.installed()
                elif choice == 3:
                    with tmgp.patched(mode=mode), tmgp.patched():
                        pass
                else:
                    try:
                        with tmgp.patched(mode=mode):
                            raise KeyError("inside")
                    except KeyError:
                        pass
                ops[t] += 1
                if ops[t] % 10 == 0:
                    time.sleep(0.001)  # let the gathering thread have the GIL now and then
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(f"thread {t}: {err!r}")

    workers = [threading.Thread(target=toggler, args=(t,), daemon=True) for t in range(threads)]
    for worker in workers:
        worker.start()
    from torchmetrics.utilities.distributed import gather_all_tensors as gather  # torchmetrics' own object

    graphs_kept = 0
    try:
        for step in range(gathers):
            # Uneven on odd steps, so both paths of the gather run under contention.
            rows = 3 + (rank if step % 2 else 0)
            x = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2).add(rank * 100).requires_grad_(True)
            in_block = step % 3 != 2
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if in_block:
                    with tmgp.patched():
                        out = gather(x, group)
                else:
                    out = gather(x, group)
            if len(out) != len(members):
                errors.append(f"step {step}: {len(out)} entries for {len(members)} ranks")
                continue
            for r, entry in zip(members, out, strict=True):
                want_rows = 3 + (r if step % 2 else 0)
                want = torch.arange(want_rows * 2, dtype=torch.float64).reshape(want_rows, 2).add(r * 100)
                if not torch.equal(entry.detach(), want):
                    errors.append(f"step {step}: entry {r} has wrong values")
            if in_block:
                # local mode: the caller's own tensor; global mode (a group of one): an output of the node
                kept = out[index] is x if mode == "local" else out[index].requires_grad
                if not kept:
                    errors.append(f"step {step}: graph lost inside a patched() block")
                else:
                    graphs_kept += 1
                    (out[index] * 2).sum().backward()
                    if not torch.equal(x.grad, torch.full_like(x, 2.0)):  # type: ignore[arg-type]
                        errors.append(f"step {step}: wrong gradient inside a block")
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    alive = [w.name for w in workers if w.is_alive()]
    tmgp.unpatch()
    after = _original_state()
    return {
        "rank": rank,
        "world": world,
        "ops": sum(ops),
        "installed_seen": sum(installed_seen),
        "graphs_kept": graphs_kept,
        "errors": errors[:20] + ([f"... {len(alive)} threads still alive"] if alive else []),
        "state_differences": _state_differences(before, after),
        "patched_at_end": tmgp.is_patched(),
    }


@pytest.fixture(params=["local", "global"])
def mode(request: pytest.FixtureRequest) -> str:
    """The mode the threads toggle. Local mode installs nothing on native torchmetrics, so there the "original
    restored" check would compare torchmetrics with itself: skipped, the global mode (which installs) runs."""
    if request.param == "local" and NATIVE:
        pytest.skip(
            "native torchmetrics: local mode installs nothing, so toggling it cannot disturb the original; "
            "the global-mode variant swaps the code and checks the restore"
        )
    return str(request.param)


@pytest.fixture
def without_autopatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh ranks inherit the environment when they start: each starts from torchmetrics as shipped."""
    monkeypatch.setenv("TORCHMETRICS_GRADPATCH_AUTOPATCH", "0")


def _check(result: dict[str, object], gathers: int, min_ops: int) -> None:
    assert result["errors"] == [], result
    assert result["state_differences"] == [], result
    assert result["patched_at_end"] is False
    assert result["ops"] >= min_ops  # type: ignore[operator]
    assert result["installed_seen"] > 0, "no block saw the code swapped: the restore check would be vacuous"  # type: ignore[operator]
    assert result["graphs_kept"] == sum(1 for step in range(gathers) if step % 3 != 2)


def _stress(rank: int, world_size: int, gathers: int, min_ops: int, mode: str) -> dict[str, Any]:
    return run_stress(gathers, min_ops, 8, mode)


# Fresh ranks by design (both tests): the state recorded first must be torchmetrics as shipped, never one that a
# warm rank's earlier patch was undone into, or an inexact restore would pass unseen.
@pytest.mark.usefixtures("without_autopatch")
def test_toggling_from_8_threads_while_gathering(mode: str) -> None:
    for result in run_ranks(_stress, 2, 60, 3000, mode, timeout=150, fresh=True):
        _check(result, 60, 3000)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("without_autopatch")
def test_toggling_from_8_threads_while_gathering_long(mode: str) -> None:
    gathers, ops = sized(full=1500, ci=200), sized(full=50000, ci=8000)
    for result in run_ranks(_stress, 3, gathers, ops, mode, timeout=800, fresh=True):
        _check(result, gathers, ops)
