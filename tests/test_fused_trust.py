"""A collection joins its one exchange only where it trusts every class in it, on real gloo ranks.

The exchange runs every member's update before any member's ``compute()``; torchmetrics runs them one after another.
Each case here is a member of the user's whose result depends on that order (it reads or computes a peer, shares a
module or an input with one, changes what it keeps in ``compute()``, reads the sync flags, syncs itself, filters its
own arguments), or a collection subclass that computes some members only. Untrusted, every such collection gives
torchmetrics' own values, states and gradients bit for bit, and the exchange takes no member over (its member table
crosses, nothing else). Named with ``trust()``, a class joins, and the check mode reports the difference on every
rank: what docs/fused-sync.md asks of a class before it is trusted. Ranks that trust differently step aside
together.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torchmetrics
from torchmetrics import Metric, MetricCollection
from torchmetrics.regression import MeanSquaredError

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests.test_fused import same, worlds
from tests.test_fused_step import NO_CACHE, alike
from torchmetrics_gradpatch import FusedSyncError
from torchmetrics_gradpatch.fused import collection, membership


class Total(Metric):
    """A sum of squared errors; ``peers`` (a plain list, not child modules) are other members it may read."""

    full_state_update = False

    def __init__(self, peers: tuple[Metric, ...] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.peers = list(peers)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total = self.total + (preds - target).square().sum()

    def compute(self) -> torch.Tensor:
        return self.total


class ReadsPeerState(Total):
    def compute(self) -> torch.Tensor:
        return self.total + self.peers[0].sum_squared_error  # the peer's local states under torchmetrics' order


class ComputesPeer(Total):
    def compute(self) -> torch.Tensor:
        return self.total + self.peers[0].compute()  # the peer syncs again under torchmetrics' order


class Reverses(Metric):
    """A list state synced with no reduction, reversed in place by ``compute()`` (in a compute group with a twin)."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("items", [], dist_reduce_fx=None)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.items.append(preds - target)

    def compute(self) -> torch.Tensor:
        self.items.reverse()
        return torch.cat(self.items)[:3].sum()


class SharedNorm(Total):
    """Shares a ``BatchNorm1d`` with a peer: its update moves the running mean that ``compute()`` reads."""

    def __init__(self, norm: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = norm

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total = self.total + self.norm(preds.detach().unsqueeze(-1)).square().sum()

    def compute(self) -> torch.Tensor:
        return self.total + self.norm.running_mean.sum()


class KeepsInput(Total):
    """Keeps the target it was given and changes it in place in ``compute()``: the next member sees the change."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds, target)
        self.kept = target

    def compute(self) -> torch.Tensor:
        self.kept.add_(1.0)
        return self.total


class SyncsItself(Total):
    """Returns its local and its synced value side by side (``unsync()`` and ``sync()`` in ``compute()``)."""

    def compute(self) -> torch.Tensor:
        self.unsync()
        local = self.total.clone()
        self.sync()
        return torch.stack([local, self.total])


class ReadsFlags(Total):
    def compute(self) -> torch.Tensor:
        return self.total * (2.0 if self._to_sync else 1.0)


class CountsFilter(Total):
    def _filter_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        self.filtered = getattr(self, "filtered", 0) + 1
        return super()._filter_kwargs(**kwargs)


class FirstOnly(MetricCollection):
    """Computes and forwards its first member only (a collection subclass of the user's)."""

    def _compute_and_reduce(self, method_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        key, metric = next(iter(self.items(keep_base=True, copy_state=False)))
        if method_name == "compute":
            return {key: metric.compute()}
        return {key: metric(*args, **metric._filter_kwargs(**kwargs))}


def _norm() -> torch.nn.Module:
    return torch.nn.BatchNorm1d(1, dtype=torch.float64)


def _cases() -> dict[str, Callable[[], MetricCollection]]:
    """name -> a collection in which a member of the user's depends on torchmetrics' member-by-member order."""
    step = {"dist_sync_on_step": True}

    def reads_state() -> MetricCollection:
        mse = MeanSquaredError(**step)
        return MetricCollection({"a": ReadsPeerState(peers=(mse,), **step), "b": mse})  # (keys sorted) it reads b first

    def shared_norm() -> MetricCollection:
        norm = _norm()
        return MetricCollection({"a": SharedNorm(norm, **step), "b": SharedNorm(norm, **step)})

    def computes_peer() -> MetricCollection:
        mse = MeanSquaredError(**step, **NO_CACHE)
        return MetricCollection({"a": ComputesPeer(peers=(mse,), **step), "b": mse})

    cases = {
        "reads a peer's states": reads_state,
        "computes a peer": computes_peer,
        "changes a shared list": lambda: MetricCollection(
            {"a": Reverses(**step), "b": Reverses(**step)}, compute_groups=[["a", "b"]]
        ),
        "shares a module": shared_norm,
        "changes a kept input": lambda: MetricCollection({"a": KeepsInput(**step), "b": KeepsInput(**step)}),
        "syncs itself": lambda: MetricCollection({"mse": MeanSquaredError(**step), "self": SyncsItself(**step)}),
        "reads the sync flags": lambda: MetricCollection({"mse": MeanSquaredError(**step), "f": ReadsFlags(**step)}),
        "filters its arguments": lambda: MetricCollection({"c": CountsFilter(**step), "t": Total(**step)}),
    }
    if hasattr(MetricCollection, "_compute_and_reduce"):  # torchmetrics 1.0 on
        cases["a collection subclass"] = lambda: FirstOnly({"a": Total(**step), "b": MeanSquaredError(**step)})
    return cases


def batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * k + rank)
    n = 3 + rank + k
    return torch.randn(n, dtype=torch.float64, generator=generator), torch.randn(
        n, dtype=torch.float64, generator=generator
    )


def _held(metrics: MetricCollection) -> dict[str, Any]:
    """Every member's states, counts, caches and flags, and what the cases keep beside them."""
    out: dict[str, Any] = {}
    for key, metric in metrics._modules.items():
        for name in (*metric._defaults, "_update_count", "_forward_cache", "_computed", "_is_synced", "_to_sync"):
            value = getattr(metric, name, None)
            out[f"{key}.{name}"] = value.detach() if isinstance(value, torch.Tensor) else value
        for name in ("kept", "filtered"):
            if name in vars(metric):
                out[f"{key}.{name}"] = vars(metric)[name]
        if isinstance(getattr(metric, "norm", None), torch.nn.Module):
            out[f"{key}.norm"] = metric.norm.running_mean.clone()
    return out


def _detached(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value.detach() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def outcomes() -> Iterator[list[collection.Outcome]]:
    """What every collection exchange inside settled (calling through to the real one)."""
    real, seen = collection.sync_members, []

    def spy(*args: Any, **kwargs: Any) -> collection.Outcome:
        outcome = real(*args, **kwargs)
        seen.append(dataclasses.replace(outcome, synced=dict(outcome.synced)))  # as settled: the adapters take them
        return outcome

    collection.sync_members = spy
    try:
        yield seen
    finally:
        collection.sync_members = real


def _steps(make: Callable[[], MetricCollection], rank: int, sync: str, mode: str, check: bool = False) -> list[Any]:
    """Two training steps (forward, a loss from every value, backward) and a ``compute()``: per step the values,
    the input's gradient and what every member holds."""
    metrics, record = make(), []
    with tg.patched(sync=sync, mode=mode, check=check):
        for k in range(2):
            preds, target = batch(rank, k)
            leaf = preds.clone().requires_grad_()
            values = metrics(leaf, target)
            torch.stack([v.sum() for v in values.values()]).sum().backward()
            record.append((_detached(values), leaf.grad, _held(metrics)))
        record.append((_detached(metrics.compute()), None, _held(metrics)))
    return record


def _alike_runs(got: list[Any], expected: list[Any], what: str) -> None:
    for k, ((values, grad, held), (values_e, grad_e, held_e)) in enumerate(zip(got, expected, strict=True)):
        assert alike(values, values_e), (what, k, values, values_e)
        assert (grad is None) == (grad_e is None) and (grad is None or same(grad, grad_e)), (what, k, grad, grad_e)
        assert held.keys() == held_e.keys(), (what, k)
        for name in held_e:
            assert alike(held[name], held_e[name]), (what, k, name, held[name], held_e[name])


def _untrusted_classes_run_torchmetrics_own_path(rank: int, world_size: int, mode: str) -> None:
    for what, make in _cases().items():
        expected = _steps(make, rank, "torchmetrics", mode)
        with outcomes() as seen:
            got = _steps(make, rank, "fused", mode)
        # the exchange ran at every step and compute() (the member table crossed), and took no member over
        assert len(seen) == 3 and not any(o.synced or o.joins for o in seen), (what, seen)
        explained = tg.explain(make(), step=True)
        assert all(text.startswith("runs torchmetrics' own path: ") for text in explained.values()), (what, explained)
        _alike_runs(got, expected, what)


@pytest.mark.parametrize("mode", ["local", "global"])
@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_untrusted_classes_run_torchmetrics_own_path(world_size: int, mode: str) -> None:
    run_ranks(_untrusted_classes_run_torchmetrics_own_path, world_size, mode, timeout=240)


def _trusted_class_joins_and_the_check_reports_the_difference(rank: int, world_size: int) -> None:
    make = _cases()["reads a peer's states"]
    tg.trust(ReadsPeerState)
    assert tg.explain(make(), step=True) == dict.fromkeys("ab", "joins the collection's exchange")
    with outcomes() as seen:
        _steps(make, rank, "fused", "local")
    assert all(len(o.synced) == 2 for o in seen[:2]), seen  # both members crossed in each step's exchange
    with pytest.raises(FusedSyncError, match="check mode: the fused sync of a MetricCollection's forward differs"):
        _steps(make, rank, "fused", "local", check=True)


@pytest.mark.parametrize("world_size", worlds(2))
def test_trusted_class_joins_and_the_check_reports_the_difference(world_size: int) -> None:
    run_ranks(_trusted_class_joins_and_the_check_reports_the_difference, world_size, timeout=120)


def _ranks_that_trust_differently_step_aside_together(rank: int, world_size: int) -> None:
    if rank == 0:
        tg.trust(Total)  # rank 0 alone: its exchange would take the member over

    def make() -> MetricCollection:
        return MetricCollection({"mse": MeanSquaredError(dist_sync_on_step=True), "t": Total(dist_sync_on_step=True)})

    expected = _steps(make, rank, "torchmetrics", "local")
    with outcomes() as seen:
        got = _steps(make, rank, "fused", "local")
    assert len(seen) == 3 and not any(o.synced or o.joins for o in seen), seen
    _alike_runs(got, expected, "trusted on rank 0 only")


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_ranks_that_trust_differently_step_aside_together(world_size: int) -> None:
    run_ranks(_ranks_that_trust_differently_step_aside_together, world_size, timeout=120)


def test_trust_takes_classes_only_and_status_lists_them() -> None:
    with pytest.raises(TypeError, match="takes Metric or MetricCollection subclasses"):
        tg.trust(Total())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes Metric or MetricCollection subclasses"):
        tg.trust(torch.nn.Linear)
    assert not membership.trusted(Total, Metric)
    assert membership.trusted(MeanSquaredError, Metric)
    try:
        tg.trust(Total, FirstOnly)
        assert membership.trusted(Total, Metric) and membership.trusted(FirstOnly, MetricCollection)
        assert not membership.trusted(ReadsPeerState, Metric)  # a subclass is named on its own
        names = tg.status().trusted
        assert f"{__name__}.Total" in names and f"{__name__}.FirstOnly" in names, names
        assert f"trusted:          {__name__}.Total (trust())" in str(tg.status())
    finally:
        membership._named.difference_update({Total, FirstOnly})


def test_a_method_replaced_on_a_torchmetrics_class_makes_it_the_users() -> None:
    class Squared(MeanSquaredError):  # noqa: N818 (a Metric, named after its base)
        pass

    assert not membership.trusted(Squared, Metric)  # defined here, not in torchmetrics
    original = MeanSquaredError.__dict__["compute"]
    MeanSquaredError.compute = lambda self: original(self)  # type: ignore[method-assign]
    try:
        assert not membership.trusted(MeanSquaredError, Metric)
    finally:
        MeanSquaredError.compute = original  # type: ignore[method-assign]
    assert MeanSquaredError.__dict__["compute"] is original
    assert membership.trusted(MeanSquaredError, Metric)
    assert torchmetrics.MetricCollection is MetricCollection and membership.trusted(MetricCollection, MetricCollection)
