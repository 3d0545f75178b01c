"""The training-style script that ``tests/test_multinode.py`` runs with one torchrun per network namespace.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank N --master-addr ADDR ... tests/_multinode_job.py --out DIR

Every rank syncs metric losses over the world and over its node-local subgroup (``dist.new_subgroups``), with
sum states and uneven ``cat`` states, and gathers directly with :func:`torchmetrics_gradpatch.gather_all_tensors`,
each in local and global mode. It backpropagates and saves its losses, gradients and identity (global rank,
node, group rank, network namespace) to ``DIR/rank<global rank>.pt``; the test rebuilds every rank's inputs
with the functions below and compares against single-process references. With ``--die-rank R`` the job
instead proves the group works, then rank ``R`` SIGKILLs itself and the others keep syncing.
"""

from __future__ import annotations

import torchmetrics_gradpatch  # first thing in the program, in every process on every node

# isort: split
import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchmetrics.utilities.distributed as tm_dist
from torch.distributed.elastic.multiprocessing.errors import record

from tests._rank_tools import CatSquaredError, SumSquaredError

F64 = torch.float64
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
#: Per global rank batch sizes: uneven, so ``cat`` states take torchmetrics' pad-gather-trim path.
ROWS = (3, 5, 2, 4)
SCOPES = ("world", "node")
KINDS = ("sum", "cat", "gather")
MODES = ("local", "global")
CASES = tuple((scope, kind, mode) for scope in SCOPES for kind in KINDS for mode in MODES)
#: Process-group timeout: bounds any collective a dead peer could leave waiting (the test's bounds are larger).
PG_TIMEOUT = timedelta(seconds=60)


# -------------------------------------------------------------------------------------- inputs (test uses too)


def members(scope: str, rank: int) -> list[int]:
    """Global ranks in ``rank``'s group: all of them, or the ranks of its node (torchrun numbers nodes in order)."""
    if scope == "world":
        return list(range(WORLD))
    first = rank // PER_NODE * PER_NODE
    return list(range(first, first + PER_NODE))


def metric_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s predictions and targets (float64, ``ROWS[rank]`` samples)."""
    gen = torch.Generator().manual_seed(2000 + rank)
    return torch.randn(ROWS[rank], generator=gen, dtype=F64), torch.randn(ROWS[rank], generator=gen, dtype=F64)


def gather_input(rank: int) -> torch.Tensor:
    """The tensor rank ``rank`` gathers directly: ``ROWS[rank]`` x 2, float64."""
    gen = torch.Generator().manual_seed(3000 + rank)
    return torch.randn(ROWS[rank], 2, generator=gen, dtype=F64)


def gather_loss(entries: list[torch.Tensor], member: int) -> torch.Tensor:
    """Group member ``member``'s loss from the gathered entries: differs per member, uses every entry
    nonlinearly and depends on their order, so a misplaced entry changes both value and gradient."""
    total = torch.zeros((), dtype=F64)
    for j, entry in enumerate(entries):
        total = total + (member + 1.5) * (j + 0.5) * (entry**2).sum() + (member - j) * entry.sin().sum()
    return total


# -------------------------------------------------------------------------------------- the job


def _run_case(kind: str, mode: str, group: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    values: list[torch.Tensor] = []
    if kind == "gather":
        x = gather_input(rank).requires_grad_()
        entries = torchmetrics_gradpatch.gather_all_tensors(x, group, mode=mode)
        values = [e.detach().clone() for e in entries]
        loss = gather_loss(entries, dist.get_rank(group))
        mode_seen, installed = mode, True  # this package's own gather, called directly
    else:
        x, target = metric_inputs(rank)
        x.requires_grad_()
        metric_class = SumSquaredError if kind == "sum" else CatSquaredError
        metric = metric_class(dist_sync_on_step=True, process_group=group).set_dtype(F64)
        with torchmetrics_gradpatch.patched(mode=mode):  # the metric syncs through torchmetrics' own gather name
            mode_seen = torchmetrics_gradpatch.status().mode
            installed = bool(torchmetrics_gradpatch.status().applied_to)  # else torchmetrics' own gather runs
            loss = metric(x, target)
    loss.backward()  # in global mode every member of the group must run it: they all do
    assert x.grad is not None
    return {
        "loss": loss.detach(),
        "grad": x.grad.detach().clone(),
        "values": values,
        "mode_seen": mode_seen,
        "installed": installed,
    }


def _identity(node_group: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    netns = os.stat("/proc/self/ns/net").st_ino  # which network namespace ("host") this process runs in
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "node_rank": int(os.environ["GROUP_RANK"]),  # torchrun's name for the node rank
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "netns": netns,
        "node_group_rank": dist.get_rank(node_group),
        "node_group_size": dist.get_world_size(node_group),
        # the global ranks in this rank's node subgroup, in group-rank order, as the subgroup itself sees them
        "node_group_members": [int(t) for t in tm_dist.gather_all_tensors(torch.tensor(rank), node_group)],
        "node_group_netns": [int(t) for t in tm_dist.gather_all_tensors(torch.tensor(netns), node_group)],
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "native": torchmetrics_gradpatch.status().native,
        "torchmetrics": torchmetrics_gradpatch.status().torchmetrics_version,
    }


def _die_or_keep_syncing(die_rank: int, out: Path) -> None:
    """Rank ``die_rank`` SIGKILLs itself after one good sync; every other rank keeps syncing until it fails."""
    rank = dist.get_rank()
    tm_dist.gather_all_tensors(torch.tensor([rank]))  # the group works
    dist.barrier()
    if rank == die_rank:
        (out / "died_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # what a training loop does next: another synced step; the dead peer makes it raise
        tm_dist.gather_all_tensors(torch.arange(ROWS[rank], dtype=F64))


@record  # a failing rank's traceback also lands in torchrun's error summary
def _node_group(size: int) -> Any:
    """This node's group, one subgroup per node, the way multi-node jobs make node-local groups.

    ``dist.new_subgroups`` where it works; torch 2.0's refuses without CUDA ("Subgroups can only be created when
    CUDA is available", before any collective), so there every rank creates every node's group with
    ``dist.new_group``, which is what ``new_subgroups`` does on newer torch.
    """
    try:
        return dist.new_subgroups(group_size=size)[0]
    except ValueError as err:
        if "CUDA" not in str(err):
            raise
    rank, mine = dist.get_rank(), None
    for start in range(0, dist.get_world_size(), size):
        group = dist.new_group(list(range(start, start + size)))  # every rank takes part in creating all
        if start <= rank < start + size:
            mine = group
    return mine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<N>.pt")
    parser.add_argument("--die-rank", type=int, default=None, help="this global rank SIGKILLs itself")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    torch.set_num_threads(1)
    if args.die_rank is not None:
        _die_or_keep_syncing(args.die_rank, args.out)
    node_group = _node_group(int(os.environ["LOCAL_WORLD_SIZE"]))
    result: dict[str, Any] = {"identity": _identity(node_group), "cases": {}}
    for scope, kind, mode in CASES:
        group = None if scope == "world" else node_group
        result["cases"][(scope, kind, mode)] = _run_case(kind, mode, group)
    rank = dist.get_rank()
    tmp = args.out / f"rank{rank}.pt.tmp"
    torch.save(result, tmp)
    tmp.rename(args.out / f"rank{rank}.pt")
    dist.barrier()  # every rank saved and no collective is in flight
    print(f"rank {rank}: done", flush=True)
    sys.stderr.flush()
    # Leave without tearing gloo down: this job checks gradients, not teardown (tests/test_example.py runs the
    # documented destroy_process_group). torch 2.0.1's gloo can deadlock in destroy_process_group (about 1 in
    # 30) and torch 2.13-2.15 can abort at interpreter exit while a group is alive; os._exit does neither.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
