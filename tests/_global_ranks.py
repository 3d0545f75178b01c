"""Functions that run inside spawned ranks for the global-mode tests (module-level, so ``spawn`` imports them).

Each rank returns plain data (detached tensors, lists, strings); ``tests/test_global_mode.py`` compares it with
single-process float64 references computed in the parent from the same deterministic inputs. Everything runs
in few spawns: :func:`run_all` does every case of one world size.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
import torchmetrics
import torchmetrics.utilities.distributed as tm_dist
from packaging.version import Version
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_cat

import torchmetrics_gradpatch
from tests._rank_tools import CatSquaredError, SumSquaredError, record_collectives, synced_state_loss
from torchmetrics_gradpatch import gather_all_tensors, patched

F64 = torch.float64
FEATURES = 3
# Per-rank rows of the cat-state and contrastive cases: uneven, and rank 1 of 3 holds none in "zero_rows".
ROWS = {"uneven": (3, 5, 4), "zero_rows": (2, 0, 3), "equal": (4, 4, 4)}


# ------------------------------------------------------------------------------------------------- inputs


def gather_input(case: str, rank: int) -> torch.Tensor:
    """The tensor rank ``rank`` contributes to gather ``case`` (float64, requires grad)."""
    gen = torch.Generator().manual_seed(100 + rank)
    if case == "equal":
        x = torch.randn(2, 3, generator=gen, dtype=F64)
    elif case == "uneven_rows":  # includes a rank with zero rows
        x = torch.randn((2, 0, 3)[rank % 3], 2, generator=gen, dtype=F64)
    elif case == "uneven_all_dims":
        x = torch.randn(rank % 3 + 1, 3 - rank % 3, generator=gen, dtype=F64)
    elif case == "scalar":
        x = torch.randn((), generator=gen, dtype=F64)
    elif case == "non_contiguous":
        x = torch.randn(4, 3, generator=gen, dtype=F64).t()
    else:
        raise ValueError(case)
    return x.requires_grad_()


GATHER_CASES = ("equal", "uneven_rows", "uneven_all_dims", "scalar", "non_contiguous")


def gather_loss(entries: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Rank ``rank``'s loss from the gathered entries: different on every rank, uses every entry nonlinearly."""
    total = torch.zeros((), dtype=F64)
    for j, entry in enumerate(entries):
        total = total + (rank + 1.5) * (j + 0.5) * (entry**2).sum() + (rank - j) * entry.sin().sum()
    return total


def model_inputs(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s features and targets for the model-and-metric cases."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(rows, FEATURES, generator=gen, dtype=F64), torch.randn(rows, generator=gen, dtype=F64)


def weight() -> torch.Tensor:
    """The model parameter, identical on every rank (as DDP replicas are)."""
    return torch.linspace(-1.0, 1.0, FEATURES, dtype=F64)


# ------------------------------------------------------------------------------------------------- metrics


class ManyStates(Metric):
    """Several gathered states, all with graphs: a sum state, a 1-D cat state and a 2-D cat state."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sse", default=torch.tensor(0.0, dtype=F64), dist_reduce_fx="sum")
        self.add_state("abs_errors", default=[], dist_reduce_fx="cat")
        self.add_state("pairs", default=[], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.sse = self.sse + ((preds - target) ** 2).sum()
        self.abs_errors.append((preds - target).abs())
        self.pairs.append(torch.stack([preds, target * preds], dim=1))

    def compute(self) -> torch.Tensor:
        pairs = dim_zero_cat(self.pairs)
        return self.sse / 7 + dim_zero_cat(self.abs_errors).mean() + (pairs[:, 0] * pairs[:, 1]).sum() / 5


METRIC_CASES = (
    "forward_sum",
    "forward_cat",
    "sync_sum",
    "sync_cat",
    "sync_dist_default_sum",
    "sync_dist_default_cat",
    "collection",
    "many_states",
)


def metric_loss(case: str, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Run one Metric path (through torchmetrics' own gather) and return the synced loss."""
    if case in ("forward_sum", "forward_cat"):
        metric: Metric = (SumSquaredError if case == "forward_sum" else CatSquaredError)(dist_sync_on_step=True)
        return metric(preds, target)  # type: ignore[no-any-return]
    if case == "collection":
        collection = MetricCollection(
            {"sum": SumSquaredError(dist_sync_on_step=True), "cat": CatSquaredError(dist_sync_on_step=True)}
        )
        values = collection(preds, target)
        return values["sum"] + values["cat"]  # type: ignore[no-any-return]
    if case == "many_states":
        return ManyStates(dist_sync_on_step=True)(preds, target)  # type: ignore[no-any-return]
    return synced_state_loss(case, preds, target)


def metric_rows(case: str) -> tuple[int, ...]:
    return ROWS["equal"] if case.endswith("sum") else ROWS["uneven"]


def reference_metric_loss(case: str, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The same loss computed in one process on everything."""
    mse = ((preds - target) ** 2).mean()
    if case == "collection":
        return 2 * mse
    if case == "many_states":
        return ((preds - target) ** 2).sum() / 7 + (preds - target).abs().mean() + (preds * target * preds).sum() / 5
    return mse


# ---------------------------------------------------------------------------------------------- contrastive


def contrastive_loss(local: torch.Tensor, everything: torch.Tensor, offset: int) -> torch.Tensor:
    """InfoNCE-style: each local row's positive is itself among all rows of all ranks."""
    logits = local @ everything.t()
    labels = torch.arange(offset, offset + local.shape[0])
    return F.cross_entropy(logits, labels, reduction="sum")


def projection() -> torch.Tensor:
    return torch.linspace(-0.5, 0.7, FEATURES * 2, dtype=F64).reshape(FEATURES, 2)


# ------------------------------------------------------------------------------------------------- helpers


def _detach(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


# ------------------------------------------------------------------------------------------------- cases


def run_gather_case(case: str, group: Any = None, through: str = "direct") -> dict[str, Any]:
    """Global vs local gather of one case: values, collectives, and the gradient of this rank's loss."""
    rank = dist.get_rank(group)
    x = gather_input(case, dist.get_rank())
    out: dict[str, Any] = {"group_rank": rank}
    for mode in ("local", "global"):
        x.grad = None
        with record_collectives() as forward_calls:
            if through == "torchmetrics":
                with patched(mode=mode):
                    entries = tm_dist.gather_all_tensors(x, group)
            else:
                entries = gather_all_tensors(x, group, mode=mode)
        loss = gather_loss(entries, rank)
        with record_collectives() as backward_calls:
            loss.backward()
        assert x.grad is not None
        out[mode] = {
            "values": _detach(entries),
            "dtypes": [t.dtype for t in entries],
            "forward_collectives": forward_calls,
            "backward_collectives": backward_calls,
            "grad": x.grad.detach().clone(),
        }
    return out


def run_metric_case(case: str, mode: str) -> dict[str, Any]:
    """One Metric path under ``patched(mode=mode)``: this rank's parameter gradient and loss."""
    rank = dist.get_rank()
    features, target = model_inputs(rank, metric_rows(case)[rank])
    w = weight().requires_grad_()
    with patched(mode=mode), record_collectives() as forward_calls:
        loss = metric_loss(case, features @ w, target)
    with record_collectives() as backward_calls:
        loss.backward()
    assert w.grad is not None
    return {
        "loss": loss.detach(),
        "grad": w.grad.detach().clone(),
        "forward_collectives": forward_calls,
        "backward_collectives": backward_calls,
    }


def run_contrastive(mode: str, rows_key: str) -> dict[str, Any]:
    """Each rank computes its own contrastive loss from all ranks' embeddings."""
    rank = dist.get_rank()
    rows = ROWS[rows_key]
    features, _ = model_inputs(rank, rows[rank])
    p = projection().requires_grad_()
    embeddings = features @ p
    gathered = gather_all_tensors(embeddings, mode=mode)
    loss = contrastive_loss(gathered[rank], torch.cat(gathered), sum(rows[:rank]))
    loss.backward()
    assert p.grad is not None
    return {"loss": loss.detach(), "grad": p.grad.detach().clone()}


def run_all(world_size_rows: int, subgroup_ranks: list[int] | None = None) -> dict[str, Any]:
    """Every global-mode case one rank checks for one world size (``world_size_rows`` ranks use ``ROWS``)."""
    out: dict[str, Any] = {"rank": dist.get_rank(), "status_mode_outside": torchmetrics_gradpatch.status().mode}
    with patched(mode="global"):
        out["status_mode_inside"] = torchmetrics_gradpatch.status().mode
    out["gather"] = {case: run_gather_case(case) for case in GATHER_CASES}
    out["gather_via_torchmetrics"] = {
        case: run_gather_case(case, through="torchmetrics") for case in ("uneven_rows", "scalar")
    }
    out["metric"] = {(case, mode): run_metric_case(case, mode) for case in METRIC_CASES for mode in ("global", "local")}
    out["contrastive"] = {
        (mode, rows): run_contrastive(mode, rows) for mode in ("global", "local") for rows in ("uneven", "zero_rows")
    }
    if subgroup_ranks is not None:
        group = dist.new_group(subgroup_ranks)  # every rank takes part in creating it
        if dist.get_rank() in subgroup_ranks:
            out["subgroup"] = {case: run_gather_case(case, group) for case in ("equal", "uneven_rows", "scalar")}
        dist.barrier()
    return out


# ------------------------------------------------------------------------------------- agreement (issue 12)


class MaskedSquaredError(Metric):
    """A ``cat``-state metric whose ``update`` appends only the masked samples: nothing at all when none is.

    A rank whose mask is all False then syncs torchmetrics' grad-less empty ``torch.tensor([])``.
    """

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("errors", default=[], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        if bool(mask.any()):
            self.errors.append((preds[mask] - target[mask]) ** 2)

    def compute(self) -> torch.Tensor:
        return dim_zero_cat(self.errors).mean()


class MaskedModel(torch.nn.Module):
    """A backbone on every sample and a head on the selected samples only (as a detection head on positives).

    On a rank with nothing selected the head does not run: its parameters are unused there, which is what
    DDP's ``find_unused_parameters=True`` is for. Returns the predictions (zero where not selected) and the
    backbone features.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)  # the same initial weights on every rank and in the reference
        self.backbone = torch.nn.Linear(FEATURES, 4, dtype=F64)
        self.head = torch.nn.Linear(4, 1, dtype=F64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.tanh(self.backbone(x))
        preds = x.new_zeros(x.shape[0])
        if bool(mask.any()):
            preds = preds.masked_scatter(mask, self.head(features[mask]).squeeze(-1))
        return preds, features


AUX_WEIGHT = 0.01  # the per-rank activity penalty that reaches the backbone on every rank under DDP


def masked_inputs(rank: int, empty_rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s features, targets and mask: ``3 + rank`` samples, none selected on ``empty_rank``."""
    gen = torch.Generator().manual_seed(5000 + 100 * step + rank)
    rows = 3 + rank
    x = torch.randn(rows, FEATURES, generator=gen, dtype=F64)
    target = torch.randn(rows, generator=gen, dtype=F64)
    mask = torch.arange(rows) % 2 == 0  # at least one sample selected...
    if rank == empty_rank:
        mask = torch.zeros(rows, dtype=torch.bool)  # ...except on the empty rank
    return x, target, mask


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def run_masked(empty_rank: int, ddp: bool, steps: int = 2) -> dict[str, Any]:
    """The hang of issue 12: ``loss = metric(p, t, mask); loss.backward()`` with one rank's mask all False."""
    rank = dist.get_rank()
    model = MaskedModel()
    net: torch.nn.Module = model
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    out: dict[str, Any] = {"steps": []}
    for step in range(steps if ddp else 1):
        x, target, mask = masked_inputs(rank, empty_rank, step)
        model.zero_grad(set_to_none=True)
        metric = MaskedSquaredError(dist_sync_on_step=True).set_dtype(F64)
        with patched(mode="global"), record_collectives() as forward_calls:
            preds, features = net(x, mask)
            loss = metric(preds, target, mask)
        if ddp:
            loss = loss + AUX_WEIGHT * (features**2).mean()
        with record_collectives() as backward_calls:
            loss.backward()  # on every rank, the empty one included
        out["steps"].append(
            {
                "loss": loss.detach(),
                "loss_has_graph": loss.grad_fn is not None,
                "grads": _grads(model),
                "forward_collectives": forward_calls,
                "backward_collectives": backward_calls,
            }
        )
    del net
    return out


def run_grad_mode_disagreement(world_size: int) -> dict[str, Any]:
    """One rank gathers under ``torch.no_grad()`` while the others gather a tensor that requires grad.

    Each case is caught on every rank (it must raise on every rank, from the gather itself); the last gather
    shows that the group is still in step afterwards.
    """
    rank = dist.get_rank()
    out: dict[str, Any] = {"errors": {}}
    for culprit in range(world_size):
        for case in ("direct", "scalar", "metric"):
            # the metric gets samples on every rank: before torchmetrics 1.4 a rank with none cannot sync at all
            x = gather_input({"direct": "uneven_rows", "scalar": "scalar", "metric": "uneven_all_dims"}[case], rank)
            context = torch.no_grad() if rank == culprit else torch.enable_grad()
            try:
                with context, record_collectives() as calls:
                    if case == "metric":
                        metric = MaskedSquaredError(dist_sync_on_step=True).set_dtype(F64)
                        with patched(mode="global"):
                            metric(x.reshape(-1), torch.zeros(x.numel(), dtype=F64), torch.ones(x.numel(), dtype=bool))
                    else:
                        gather_all_tensors(x, mode="global")
                out["errors"][(culprit, case)] = None
            except RuntimeError as err:
                out["errors"][(culprit, case)] = (type(err).__name__, str(err), calls)
    entries = gather_all_tensors(gather_input("uneven_rows", rank), mode="global")
    gather_loss(entries, rank).backward()
    out["after"] = [t.detach() for t in entries]
    return out


def run_no_node_cases() -> dict[str, Any]:
    """No rank requires grad, or every rank gathers under ``torch.no_grad()``: plain values, no backward node."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for case in ("uneven_rows", "scalar"):
        x = gather_input(case, rank)
        for how in ("no_requires_grad", "all_no_grad"):
            with record_collectives() as calls:
                if how == "no_requires_grad":
                    entries = gather_all_tensors(x.detach(), mode="global")
                else:
                    with torch.no_grad():
                        entries = gather_all_tensors(x, mode="global")
            out[(case, how)] = {
                "has_graph": [t.grad_fn is not None for t in entries],
                "others_require_grad": [t.requires_grad for j, t in enumerate(entries) if j != rank],
                "values": [t.detach().clone() for t in entries],
                "collectives": calls,
            }
    return out


#: torchmetrics syncs an empty list state as ``torch.tensor([])`` from 1.4.0 on. Before, a rank whose ``cat`` state
#: is empty skips the gather of that state altogether (``apply_to_collection`` finds no tensor in ``[]``), so its
#: collectives no longer match its peers', with or without this package: the masked cases cannot run there.
EMPTY_STATE_SYNCED = Version(torchmetrics.__version__) >= Version("1.4.0")


def unpatched_empty_rank_forward() -> float:
    """The masked metric's forward with rank 0's mask all False, with the patch off: can torchmetrics do it itself?

    torchmetrics 1.4.3 on torch 2.0.1 cannot (rank 0 raises "No samples to concatenate" in the batch compute of
    ``forward``, and its peers lose their connection), on torch 2.13 and 2.15 it can; the masked cases are only
    meaningful where the unpatched metric's forward works.
    """
    torchmetrics_gradpatch.unpatch()
    rank = dist.get_rank()
    metric = MaskedSquaredError(dist_sync_on_step=True).set_dtype(F64)
    preds, target = torch.arange(3.0, dtype=F64), torch.zeros(3, dtype=F64)
    return float(metric(preds, target, torch.full((3,), rank != 0)))


def run_agreement(world_size: int, masked: bool) -> dict[str, Any]:
    """Every issue-12 case for one world size, in one spawn (the masked ones where torchmetrics can run them)."""
    out: dict[str, Any] = {"rank": dist.get_rank()}
    if masked:
        out["masked"] = {(e, ddp): run_masked(e, ddp) for e in range(world_size) for ddp in (False, True)}
    out["disagreement"] = run_grad_mode_disagreement(world_size)
    out["no_node"] = run_no_node_cases()
    return out


def mixed_modes() -> list[tuple[int, ...]]:
    """Rank 0 gathers in local mode, the others in global mode: their collectives do not match."""
    rank = dist.get_rank()
    x = gather_input("uneven_rows", rank)
    return [tuple(t.shape) for t in gather_all_tensors(x, mode="local" if rank == 0 else "global")]


def skip_backward(hang_seconds: float) -> str:
    """Rank 1 gathers in global mode but never runs backward; rank 0 does, and waits for rank 1 forever."""
    rank = dist.get_rank()
    x = gather_input("uneven_rows", rank)
    entries = gather_all_tensors(x, mode="global")
    if rank == 1:
        time.sleep(hang_seconds)  # "moves on" without backward, like a rank that skipped the step
        return "skipped"
    gather_loss(entries, rank).backward()
    return "finished"


# ------------------------------------------------------------------------- entries like torch's gather (issue 17)

#: the entry each rank modifies in place: its own, the next rank's, and entry 0 everywhere (the issue's example)
INPLACE_TARGETS = ("own", "next", "zero")
INPLACE_SHAPES = ("equal", "uneven_rows", "scalar")


def inplace_index(target: str, rank: int, world_size: int) -> int:
    return {"own": rank, "next": (rank + 1) % world_size, "zero": 0}[target]


def modified_loss(entries: list[torch.Tensor], rank: int, index: int) -> torch.Tensor:
    """``entries[index].mul_(2)`` then ``add_(1)``, then :func:`gather_loss`: what every rank computes."""
    entries[index].mul_(2).add_(1)
    return gather_loss(entries, rank)


def _outcome(call: Any) -> dict[str, Any]:
    try:
        return {"grad": call(), "error": None}
    except Exception as err:
        return {"grad": None, "error": f"{type(err).__name__}: {err}"}


def run_entries(world_size: int) -> dict[str, Any]:
    """In-place changes to global-mode entries, and double backward, on every rank (issue 17)."""
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank, "inplace": {}, "double": {}}
    for case in INPLACE_SHAPES:
        for target in INPLACE_TARGETS:

            def inplace(case: str = case, target: str = target) -> torch.Tensor:
                x = gather_input(case, rank)
                entries = gather_all_tensors(x, mode="global")
                modified_loss(entries, rank, inplace_index(target, rank, world_size)).backward()
                assert x.grad is not None
                return x.grad.detach().clone()

            out["inplace"][(case, target)] = _outcome(inplace)
        dist.barrier()  # whatever happened, the next case starts together
    for case in ("equal", "uneven_rows", "scalar"):
        for how in ("global", "torch") if case == "equal" else ("global",):

            def double(case: str = case, how: str = how) -> torch.Tensor:
                x = gather_input(case, rank)
                if how == "torch":
                    import torch.distributed.nn.functional as dist_nn

                    entries = list(dist_nn.all_gather(x))
                else:
                    entries = gather_all_tensors(x, mode="global")
                (first,) = torch.autograd.grad(gather_loss(entries, rank), x, create_graph=True)
                (first**2).sum().backward()
                assert x.grad is not None
                return x.grad.detach().clone()

            out["double"][(case, how)] = _outcome(double)
            dist.barrier()
    return out
