"""One exchange per MetricCollection under the fused sync, on real gloo ranks: values bit for bit as torchmetrics'
own sync gives them, at most three collectives for the whole collection, opt-out members, the list-length and
structure cases, and gradients in both modes against one process holding every rank's data.

Each rank builds the same collection twice from the same data and computes one under torchmetrics' own sync and
the other under the fused sync; every rank regenerates every rank's data from the same seeds, so the one-process
references are computed on each rank. Collectives are counted with the process group's sequence number.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.distributed import gather_all_tensors

import torchmetrics_gradpatch as tg
from benchmarks.workloads import classification_collection, scale_batches, scale_collection
from tests._rank_tools import calls, destroy_subgroup, dynamo_refusal, every_rank
from tests._ranks import run_ranks
from tests.test_fused import GATHERS, Probe, device_path, recording, same, values, worlds
from torchmetrics_gradpatch._errors import FusedSyncError
from torchmetrics_gradpatch.fused import collection, step

C = 5  # classes


def classification() -> MetricCollection:
    """The ten-member collection of ``benchmarks/workloads.py`` with ``C`` classes."""
    return classification_collection(C)


def batches(rank: int, count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s uneven batches: ``3 + 2 * rank + k`` samples in batch ``k``."""
    generator = torch.Generator().manual_seed(100 + rank)
    out = []
    for k in range(count):
        n = 3 + 2 * rank + k
        out.append((torch.randn(n, C, generator=generator).softmax(-1), torch.randint(0, C, (n,), generator=generator)))
    return out


def filled(make: Callable[[], MetricCollection], rank: int) -> MetricCollection:
    metrics = make()
    for preds, target in batches(rank):
        metrics.update(preds, target)
    return metrics


def local_states(metrics: MetricCollection) -> dict[str, dict[str, Any]]:
    return {
        str(key): {name: getattr(metric, name) for name in metric._defaults}
        for key, metric in metrics.items(keep_base=True, copy_state=False)
    }


def same_dicts(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        same_dicts(a[k], b[k]) if isinstance(a[k], dict) else same(a[k], b[k]) for k in a
    )


def compute_counted(metrics: MetricCollection, sync: str, mode: str = "local") -> tuple[dict[str, Any], int]:
    with tg.patched(mode=mode, sync=sync):
        before = calls()
        result = metrics.compute()
        return result, calls() - before


def _ten_members_bit_identical_in_one_exchange(rank: int, world_size: int, mode: str) -> None:
    expected, fused = filled(classification, rank), filled(classification, rank)
    assert len(fused.compute_groups) == 4  # stat scores, confusion matrix, AUROC and AP's lists, ECE
    reference, tm_calls = compute_counted(expected, "torchmetrics", mode)
    result, fused_calls = compute_counted(fused, "fused", mode)
    assert fused_calls == 2 and tm_calls > 40, (fused_calls, tm_calls)
    assert same_dicts(result, reference)
    # every member is back on its local states, as torchmetrics' unsync leaves them
    assert same_dicts(local_states(fused), local_states(expected))
    assert not any(m._is_synced for m in fused.values(copy_state=False))
    # accumulation goes on, and a second compute() is torchmetrics' too
    for metrics in (expected, fused):
        for preds, target in batches(rank + 7, 1):
            metrics.update(preds, target)
    assert same_dicts(compute_counted(fused, "fused", mode)[0], compute_counted(expected, "torchmetrics", mode)[0])


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("mode", ["local", "global"])
def test_ten_members_bit_identical_in_one_exchange(world_size: int, mode: str) -> None:
    run_ranks(_ten_members_bit_identical_in_one_exchange, world_size, mode, timeout=120)


def _under_torch_compile_the_exchange_runs_behind_one_graph_break(rank: int, world_size: int) -> None:
    refusal = dynamo_refusal()  # torch 2.0's dynamo refuses Python 3.11
    if refusal is not None:
        pytest.skip(refusal)
    rank = dist.get_rank()
    expected, fused = filled(classification, rank), filled(classification, rank)
    reference, _ = compute_counted(expected, "torchmetrics")
    compiled = torch.compile(lambda: fused.compute(), backend="eager")
    with tg.patched(sync="fused"):
        before = calls()
        result = compiled()
        assert calls() - before == 2
    assert same_dicts(result, reference)


def test_under_torch_compile_the_exchange_runs_behind_one_graph_break() -> None:
    run_ranks(_under_torch_compile_the_exchange_runs_behind_one_graph_break, 2, timeout=120)


def _a_shared_state_crosses_the_wire_once(rank: int, world_size: int) -> None:
    from torchmetrics_gradpatch.fused.exchange import Exchange

    rank = dist.get_rank()
    metrics = filled(classification, rank)
    members = [(str(k), m) for k, m in metrics.items(keep_base=True, copy_state=False)]
    prepared: list[Any] = []
    original = Exchange._prepared

    def counting(self: Any, metric: Any, attr: str, reduction: Any, rule: bool) -> Any:
        prepared.append(attr)
        return original(self, metric, attr, reduction, rule)

    Exchange._prepared = counting  # type: ignore[method-assign]
    try:
        with tg.patched(sync="fused"):
            done = collection.sync_members(members, "local")
            for synced in done.synced.values():
                synced.set_through_sync()
    finally:
        Exchange._prepared = original  # type: ignore[method-assign]
    # four stat-score states, one confusion matrix, AUROC's and AP's preds and target, ECE's two lists
    assert sorted(prepared) == sorted(
        ["tp", "fp", "tn", "fn", "confmat", "preds", "target", "confidences", "accuracies"]
    )
    for synced in done.synced.values():
        synced.metric.unsync()


def test_a_shared_state_crosses_the_wire_once() -> None:
    run_ranks(_a_shared_state_crosses_the_wire_once, 2, timeout=60)


def _cached_results_cost_no_collective_and_a_rank_with_a_cache_joins_the_others(rank: int, world_size: int) -> None:
    expected, fused = filled(classification, rank), filled(classification, rank)
    first, _ = compute_counted(fused, "fused")
    assert same_dicts(first, compute_counted(expected, "torchmetrics")[0])
    again, count = compute_counted(fused, "fused")
    assert count == 0  # every member cached on every rank: nothing needs a peer, as in torchmetrics' own compute()
    # what torchmetrics' own second compute() returns: on 1.2 and 1.3 a compute group's members get the group's
    # first member's cached result, so it is not always the first compute()'s
    assert same_dicts(again, compute_counted(expected, "torchmetrics")[0])
    for metrics in (expected, fused):
        for preds, target in batches(rank + 3, 1):
            metrics.update(preds, target)
    if rank == 0:  # rank 0 alone holds a (stale) cached result: it is synced with the others, not left waiting
        fused["acc"]._computed = torch.tensor(-1.0)
    result, count = compute_counted(fused, "fused")
    assert count == 2
    assert same_dicts(result, compute_counted(expected, "torchmetrics")[0])


def test_cached_results_cost_no_collective_and_a_rank_with_a_cache_joins_the_others() -> None:
    run_ranks(_cached_results_cost_no_collective_and_a_rank_with_a_cache_joins_the_others, 2, timeout=60)


class Sum(Metric):
    """A float sum, for members that opt out."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("seen", [], dist_reduce_fx="cat")

    def update(self, x: torch.Tensor) -> None:
        self.total = self.total + x.sum()
        self.seen.append(x)

    def compute(self) -> torch.Tensor:
        seen = torch.cat(self.seen) if isinstance(self.seen, list) else self.seen
        return self.total * 1000 + seen.sum() + seen.numel()


def own_gather(result: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    return gather_all_tensors(result, group)


def _members_that_opt_out_sync_as_today(rank: int, world_size: int) -> None:
    subgroup = dist.new_group(list(range(world_size)))

    def make() -> MetricCollection:
        return MetricCollection(
            {
                "joins": Sum(),
                "also": Sum(),
                "no_sync": Sum(sync_on_compute=False),
                "own_fn": Sum(dist_sync_fn=own_gather),
                "own_group": Sum(process_group=subgroup),
            },
            compute_groups=False,
        )

    expected, fused = make(), make()
    for metrics in (expected, fused):
        metrics.update(values(rank, 3, (2 + rank,), torch.float64))
    reference, _ = compute_counted(expected, "torchmetrics")
    alone = Sum(dist_sync_fn=own_gather)
    alone.update(values(rank, 3, (2 + rank,), torch.float64))
    own_fn_calls = calls()
    with tg.patched(sync="torchmetrics"):
        alone.sync(dist_sync_fn=own_gather)  # what the member with its own dist_sync_fn costs alone
    own_fn_calls = calls() - own_fn_calls
    before_group = calls(subgroup)
    result, count = compute_counted(fused, "fused")
    assert count == 2 + own_fn_calls  # the exchange, and the member with its own dist_sync_fn as today
    assert calls(subgroup) - before_group == 2  # its own group's member: the fused sync of one Metric
    assert same_dicts(result, reference)
    destroy_subgroup(subgroup)


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_members_that_opt_out_sync_as_today(world_size: int) -> None:
    run_ranks(_members_that_opt_out_sync_as_today, world_size, timeout=120)


def _a_rank_with_nothing_to_sync_computes_alone(rank: int, world_size: int) -> None:
    def quiet() -> MetricCollection:  # the usual way to log on rank 0 only
        return MetricCollection({"a": Sum(sync_on_compute=False), "b": Sum(sync_on_compute=False)})

    subgroup = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 alone sync over it

    def pair() -> MetricCollection:
        return MetricCollection({"a": Sum(process_group=subgroup), "b": Sum(process_group=subgroup)})

    made = {name: (make(), make()) for name, make in (("quiet", quiet), ("pair", pair))}
    for expected, fused in made.values():
        for metrics in (expected, fused):
            metrics.update(values(rank, 3, (2 + rank,), torch.float64))
    if rank == 0:
        expected, fused = made["quiet"]
        result, count = compute_counted(fused, "fused")
        assert count == 0 and same_dicts(result, compute_counted(expected, "torchmetrics")[0]), count
    if rank in (0, 1):
        expected, fused = made["pair"]
        before_group = calls(subgroup)
        result, count = compute_counted(fused, "fused")
        # each member syncs alone over the pair: the first exchange of that group costs two, the steady second one
        assert count == 0 and calls(subgroup) - before_group == 3, (count, calls(subgroup) - before_group)
        assert same_dicts(result, compute_counted(expected, "torchmetrics")[0])
    destroy_subgroup(subgroup)


def test_a_rank_with_nothing_to_sync_computes_alone_and_returns() -> None:
    run_ranks(_a_rank_with_nothing_to_sync_computes_alone, 3, timeout=60)


def _a_state_one_rank_cannot_prepare(rank: int, world_size: int) -> None:
    metrics = MetricCollection({"a": Sum(), "b": Sum()}, compute_groups=False)
    metrics.update(values(rank, 3, (2,), torch.float64))
    # rank 1's "b" holds cat pieces that do not concatenate: torchmetrics' own sync raises there alone
    metrics["b"].seen = [
        values(rank, 4, (2, 3), torch.float64),
        values(rank, 5, (2, 4 if rank == 1 else 3), torch.float64),
    ]
    before = local_states(metrics)
    with tg.patched(sync="fused"):
        outcome, took = outcome_of(metrics.compute)
    assert every_rank(outcome) == [outcome] * world_size and took < 5
    assert "of a MetricCollection: rank(s) [1] could not prepare" in outcome, outcome
    assert same_dicts(local_states(metrics), before)


def test_a_state_one_rank_cannot_prepare_raises_on_every_rank() -> None:
    run_ranks(_a_state_one_rank_cannot_prepare, 2, timeout=60)


class Shared(Metric):
    """One tensor state ``s`` reduced by ``reduction``: members of a compute group that reduce it apart."""

    full_state_update = False

    def __init__(self, reduction: str, dtype: torch.dtype, size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("s", torch.zeros(size, dtype=dtype), dist_reduce_fx=reduction)

    def update(self, x: torch.Tensor) -> None:
        self.s = self.s + x.to(self.s.dtype)

    def compute(self) -> torch.Tensor:
        return self.s.clone()


def _mixed_reductions_in_compute_groups(rank: int, world_size: int) -> None:
    rng = random.Random(7)
    for seed in range(12):
        dtype = rng.choice([torch.int64, torch.int32, torch.float32])
        size = rng.choice([16, 20_000])  # 20,000: large enough to be all-reduced (int64, and float max/min)
        usable = ["sum", "max", "min", "mean"] if dtype.is_floating_point else ["sum", "max", "min"]
        reductions = [rng.choice(usable) for _ in range(rng.randint(2, 5))]
        keys = [f"m{i}" for i in range(len(reductions))]
        cut = rng.randint(1, len(keys))  # two groups, each mixing reductions at random
        groups = [g for g in (keys[:cut], keys[cut:]) if g]

        expected, fused = (
            MetricCollection(
                {key: Shared(r, dtype, size) for key, r in zip(keys, reductions, strict=True)}, compute_groups=groups
            )
            for _ in range(2)
        )
        for k in range(2):
            batch = values(rank, 100 * seed + k, (size,), torch.float64) * 1000
            for metrics in (expected, fused):
                metrics.update(batch)
        reference = compute_counted(expected, "torchmetrics")[0]
        assert same_dicts(compute_counted(fused, "fused")[0], reference), (seed, dtype, size, reductions, groups)


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_compute_groups_that_mix_reductions_give_each_member_its_own(world_size: int) -> None:
    run_ranks(_mixed_reductions_in_compute_groups, world_size, timeout=120)


def outcome_of(action: Callable[[], object]) -> tuple[str, float]:
    start = time.monotonic()
    try:
        action()
    except FusedSyncError as error:
        return str(error), time.monotonic() - start
    return "synced", time.monotonic() - start


def _ranks_disagreeing_on_a_member_raise_the_same_error(rank: int, world_size: int) -> None:
    metrics = MetricCollection({"a": Sum(), "b": Sum(sync_on_compute=rank != 1)}, compute_groups=False)
    metrics.update(torch.ones(2, dtype=torch.float64))
    before = local_states(metrics)
    with tg.patched(sync="fused"):
        outcome, took = outcome_of(metrics.compute)
    outcomes = every_rank(outcome)
    assert len(set(outcomes)) == 1 and "MetricCollection member 'b'" in outcome, outcomes
    assert "rank 1: does not sync on compute" in outcome and took < 5
    assert same_dicts(local_states(metrics), before)


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_ranks_disagreeing_on_a_member_raise_the_same_error(world_size: int) -> None:
    run_ranks(_ranks_disagreeing_on_a_member_raise_the_same_error, world_size, timeout=60)


def _list_lengths_sync_and_a_shape_mismatch_raises_naming_member_and_state(rank: int, world_size: int) -> None:
    lengths = [1, 3, 2][:world_size]
    everyone = [[values(r, k, (r + 1, 2), torch.float32) for k in range(lengths[r])] for r in range(world_size)]

    class Lists(Probe):
        def compute(self) -> Any:
            return self.x

    tg.trust(Lists)  # a class made here: trusted for this call (the suite forgets it after)
    lists = Lists({"x": ([], None)})
    lists.x = everyone[rank]
    lists._update_count = 1
    metrics = MetricCollection({"lists": lists, "sum": Sum()}, compute_groups=False)
    metrics["sum"].update(torch.ones(1, dtype=torch.float64))
    with tg.patched(sync="fused"):
        before = calls()
        result = metrics.compute()
        assert calls() - before == 2
    # torchmetrics' order at equal lengths: element 0 of every rank, then element 1 of every rank that has one, ...
    assert same(
        result["lists"], [everyone[r][k] for k in range(max(lengths)) for r in range(world_size) if k < lengths[r]]
    )

    bad = Probe({"y": (torch.zeros(2), "sum")})
    bad.y = torch.zeros(2 + (rank == 1))
    bad._update_count = 1
    metrics = MetricCollection({"fine": Sum(), "bad": bad}, compute_groups=False)
    metrics["fine"].update(torch.ones(1, dtype=torch.float64))
    before_states = local_states(metrics)
    with tg.patched(sync="fused"):
        outcome, took = outcome_of(metrics.compute)
    outcomes = every_rank(outcome)
    assert len(set(outcomes)) == 1, outcomes
    assert outcome.startswith(
        "torchmetrics_gradpatch: fused sync of state 'y' of Probe (MetricCollection member 'bad')"
    )
    assert took < 5 and same_dicts(local_states(metrics), before_states)
    assert not metrics["fine"]._is_synced


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_list_lengths_sync_and_a_shape_mismatch_raises_naming_member_and_state(world_size: int) -> None:
    run_ranks(_list_lengths_sync_and_a_shape_mismatch_raises_naming_member_and_state, world_size, timeout=60)


class Loss(Metric):
    """A loss whose value depends on a sum state, a max state, the order of a ``cat`` state and its row count."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sse", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("largest", torch.tensor(-1e9, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("rows", [], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.sse = self.sse + ((preds - target) ** 2).sum()
        self.largest = torch.maximum(self.largest, preds.max())
        self.rows.append(preds.reshape(-1, 1) * 1.0)

    def compute(self) -> torch.Tensor:
        rows = torch.cat(self.rows) if isinstance(self.rows, list) else self.rows
        order = torch.arange(1, rows.shape[0] + 1, dtype=rows.dtype).reshape(-1, 1)
        return self.sse / rows.shape[0] + 0.5 * self.largest + (order * rows**3).sum() / 10


class OtherLoss(Loss):
    """The same states (a compute group with :class:`Loss`), another value."""

    def compute(self) -> torch.Tensor:
        return super().compute() ** 2 / 7


def loss_collection(**kwargs: Any) -> MetricCollection:
    # named: forward() alone does not form compute groups (the first update() does)
    return MetricCollection({"loss": Loss(**kwargs), "other": OtherLoss(**kwargs)}, compute_groups=[["loss", "other"]])


def loss_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(rank + 11)
    return [
        (
            torch.randn(2 + rank + k, generator=generator, dtype=torch.float64),
            torch.randn(2 + rank + k, dtype=torch.float64, generator=generator),
        )
        for k in range(2)
    ]


def update_with_graph(metrics: MetricCollection, preds: torch.Tensor, target: torch.Tensor) -> None:
    """``update`` with grad mode on, as ``forward``'s batch update runs, so every state keeps its graph (forward
    itself merges tensor states under ``no_grad``)."""
    members = list(metrics.values(copy_state=False))
    for metric in members:
        metric._enable_grad = True
    try:
        metrics.update(preds, target)
    finally:
        for metric in members:
            metric._enable_grad = False


def total(result: dict[str, torch.Tensor]) -> torch.Tensor:
    return result["loss"] + result["other"]


def reference_grads(world_size: int) -> list[list[torch.Tensor]]:
    """Each rank's preds' gradients of the same collection's loss in one process holding every rank's batches."""
    metrics = loss_collection(sync_on_compute=False)  # this rank holds everything
    leaves = [[p.clone().requires_grad_() for p, _ in loss_batches(r)] for r in range(world_size)]
    for r in range(world_size):
        for leaf, (_, target) in zip(leaves[r], loss_batches(r), strict=True):
            update_with_graph(metrics, leaf, target)
    total(metrics.compute()).backward()
    return [[leaf.grad for leaf in mine] for mine in leaves]  # type: ignore[misc]


def _gradients_against_one_process(rank: int, world_size: int, mode: str) -> None:
    leaves = [p.clone().requires_grad_() for p, _ in loss_batches(rank)]
    metrics = loss_collection()
    with tg.patched(mode=mode, sync="fused"):
        for leaf, (_, target) in zip(leaves, loss_batches(rank), strict=True):
            update_with_graph(metrics, leaf, target)
        assert len(metrics.compute_groups) == 1
        before = calls()
        loss = total(metrics.compute())
        assert calls() - before == 2
        before = calls()
        loss.backward()
        assert calls() - before == (1 if mode == "global" else 0)  # one backward collective for the collection
    scale = world_size if mode == "global" else 1  # global: every rank's (equal) loss reaches every rank's preds
    for leaf, expected in zip(leaves, reference_grads(world_size)[rank], strict=True):
        torch.testing.assert_close(leaf.grad, scale * expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("mode", ["local", "global"])
def test_gradients_against_one_process(world_size: int, mode: str) -> None:
    run_ranks(_gradients_against_one_process, world_size, mode, timeout=120)


@pytest.mark.parametrize("name", ["compute", "forward"])
def test_install_replaces_the_method_and_uninstall_restores_the_identical_original(name: str) -> None:
    site = {"compute": collection.SITE, "forward": step.SITE}[name]
    original = MetricCollection.__dict__[name]
    was = site.installed()
    site.uninstall()
    try:
        plain = MetricCollection.__dict__[name]
        assert not site.installed() and getattr(plain, "__wrapped__", plain) is plain
        site.install()
        replacement = MetricCollection.__dict__[name]
        assert site.installed() and replacement.__wrapped__ is plain
        site.install()  # idempotent: not wrapped twice
        assert MetricCollection.__dict__[name] is replacement
        site.uninstall()
        site.uninstall()
        assert MetricCollection.__dict__[name] is plain and not site.installed()
    finally:
        if was:
            site.install()
    assert MetricCollection.__dict__[name] is original


def test_the_fused_sync_in_force_installs_both_and_status_names_them() -> None:
    with tg.patched(sync="fused"):
        assert collection.SITE.installed() and step.SITE.installed()
        applied = " ".join(tg.status().sync_applied_to)
        assert "MetricCollection.compute" in applied and "MetricCollection.forward" in applied
    with tg.patched(sync="torchmetrics"):
        assert not collection.SITE.installed() and not step.SITE.installed()


def test_without_a_process_group_compute_is_torchmetrics_own() -> None:
    assert not dist.is_initialized()
    metrics = filled(classification, 0)
    expected = filled(classification, 0)
    with tg.patched(sync="fused"):
        result = metrics.compute()
    assert same_dicts(result, expected.compute())


def scaled(rank: int, num_classes: int) -> MetricCollection:
    metrics = scale_collection(num_classes)
    for preds, target in scale_batches(rank, num_classes):
        metrics.update(preds, target)
    return metrics


def _thousand_classes_reduce_the_confusion_matrix(rank: int, world_size: int, mode: str) -> None:
    expected, fused = scaled(rank, 1000), scaled(rank, 1000)
    reference, tm_calls = compute_counted(expected, "torchmetrics", mode)
    with recording("all_reduce") as reductions:
        result, fused_calls = compute_counted(fused, "fused", mode)
    # the header, the payload (the [C] stat scores ride in it), one int64 sum for the 8 MB confusion matrix
    assert fused_calls == 3 and len(reductions) == 1 and reductions[0][1] == 8 * 1000 * 1000, (fused_calls, reductions)
    assert tm_calls > 10, tm_calls
    assert same_dicts(result, reference), {
        k: (result[k], reference[k]) for k in result if not same(result[k], reference[k])
    }
    assert same_dicts(local_states(fused), local_states(expected))


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("mode", ["local", "global"])
def test_thousand_classes_reduce_the_confusion_matrix(world_size: int, mode: str) -> None:
    run_ranks(_thousand_classes_reduce_the_confusion_matrix, world_size, mode, timeout=120)


def _a_member_of_another_class_is_named_per_rank(rank: int, world_size: int) -> None:
    from torchmetrics.aggregation import MeanMetric, SumMetric

    metrics = MetricCollection({"m": MeanMetric() if rank == 0 else SumMetric(), "s": Sum()}, compute_groups=False)
    metrics.update(torch.ones(2, dtype=torch.float64))
    with tg.patched(sync="fused"):
        outcome, _ = outcome_of(metrics.compute)
    outcomes = every_rank(outcome)
    assert outcomes == [outcome] * world_size, outcomes  # one rank's log suffices
    for r, held in enumerate((MeanMetric(), SumMetric())):  # state names differ by line (0.11: "value")
        states = ", ".join(f"{name}: sum" for name in held._defaults)
        assert f"rank {r}: 'm': {type(held).__name__} ({states})" in outcome, outcome


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_a_member_of_another_class_is_named_per_rank_in_one_text(world_size: int) -> None:
    run_ranks(_a_member_of_another_class_is_named_per_rank, world_size, timeout=60)


def _collection_on_the_device_path(rank: int, world_size: int) -> None:
    expected, fused = scaled(rank, 300), scaled(rank, 300)  # a 720 kB confusion matrix
    reference, _ = compute_counted(expected, "torchmetrics")
    chunk = 64 * 1024
    with device_path(chunk), recording(*GATHERS) as gathers, recording("all_reduce") as reductions:
        result, count = compute_counted(fused, "fused")
    # the stat scores (4 x [300] int64) are streamed in one chunk; the confusion matrix reduced in 11 chunks
    assert count == 2 + 1 + 11 and len(reductions) == 11, (count, reductions)
    assert max(size for _, size in gathers[2:] + reductions) <= chunk
    assert same_dicts(result, reference)


def test_collection_on_the_device_path() -> None:
    run_ranks(_collection_on_the_device_path, 2, timeout=120)


#: this module's own Metric classes, trusted in its rank bodies: its subject is the collection's exchange, not which
#: classes the exchange trusts (tests/test_fused_trust.py)
TRUSTED = (Sum, Shared, Loss, OtherLoss, Probe)


def _a_wrapper_cached_inside_issues_no_collective(rank: int, world_size: int) -> None:
    """A wrapper computes through the Metrics inside it (torchmetrics 1.0 on caches nothing of its own): once they hold
    their results, a second ``compute()`` issues no collective, as torchmetrics' own, so one rank may call it alone."""
    from torchmetrics import MeanSquaredError, wrappers

    metrics = MetricCollection({"a": MeanSquaredError(), "mm": wrappers.MinMaxMetric(MeanSquaredError())})
    metrics.update(torch.ones(3), torch.zeros(3))
    with tg.patched(sync="fused"):
        first = metrics.compute()
        before = calls()
        if rank == 0:
            again = metrics.compute()  # rank 0 alone: the others do not call it
            assert calls() == before and all(same(again[k], first[k]) for k in first), (calls() - before, again, first)
    dist.barrier()


def test_a_wrapper_cached_inside_issues_no_collective() -> None:
    run_ranks(_a_wrapper_cached_inside_issues_no_collective, 2, timeout=60)
