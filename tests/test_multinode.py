"""Multi-node torchrun: two "hosts" made of network namespaces, one torchrun each, 2 ranks per node.

The test creates two network namespaces joined by a veth pair (``tests/_netns.py``) and starts
``torchrun --nnodes 2 --nproc-per-node 2`` inside each (``ip netns exec``), rendezvousing on the first node's
address with gloo bound to the veth device. ``tests/_multinode_job.py`` then syncs metric losses over the world
and over node-local subgroups, where a rank's group rank differs from its global rank (ranks 2 and 3 are 0 and
1 of their node's group), in local and global mode; every rank's gradient is compared here with a
single-process float64 reference built from the same deterministic inputs:

* local mode: rank g's gradient is the gradient of *its own* loss w.r.t. its own input (only its own entry of
  the gathered states carries a graph; torchmetrics >= 1.6 does this natively, the patch elsewhere);
* global mode: rank g's gradient is the sum over its group's members r of d loss_r / d x_g; for a synced
  metric every member computes the same loss, so that is group size x the local-mode gradient.

A second test SIGKILLs a worker on the second node and checks that both torchrun agents exit non-zero within
:data:`DEATH_BOUND` seconds and leave no process behind.

Runs only as root with ``ip`` (iproute2); skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

from tests import _multinode_job as job
from tests import _netns
from tests._subprocess import ROOT, python_path

TORCH = Version(importlib.metadata.version("torch"))
RTOL = 1e-12
# Static rendezvous (--master-addr/--node-rank): node 0's agent hosts the store, no election between the nodes.
# Inside fresh namespaces every port is free, whatever runs on the host or in parallel runs.
MASTER_PORT = 29500
#: How long the whole two-node job may take (measured 13-30 s on 2 shared cores).
JOB_TIMEOUT = 180.0
#: Both agents must have exited this many seconds after the worker died (measured on 2 busy cores: 1-7 s). It is
#: below the job's process-group timeout (60 s), so passing means the death was noticed, not timed out.
DEATH_BOUND = 30.0
SCRIPT = ROOT / "tests" / "_multinode_job.py"

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(Version(TORCH.base_version) < Version("2.0"), reason=f"torch {TORCH} < 2.0"),
    # a last resort: the waits below end (and clean up) well before it; includes the module fixture's job
    pytest.mark.timeout(JOB_TIMEOUT + 90),
]


# ------------------------------------------------------------------------------------------- running torchrun


@contextmanager
def _hosts() -> Iterator[_netns.Hosts]:
    """:func:`tests._netns.two_hosts`, or a skip with the reason where namespaces cannot be made."""
    stack = ExitStack()
    try:
        hosts = stack.enter_context(_netns.two_hosts())
    except _netns.NamespacesUnavailableError as err:
        pytest.skip(f"network namespaces cannot be made here: {err}")
    with stack:
        yield hosts


def _torchrun(hosts: _netns.Hosts, node: int, out: Path, *job_args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """Start node ``node``'s torchrun inside its namespace; returns the process and its console log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHMETRICS_GRADPATCH_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)  # a test run that is itself under torchrun must not leak its own identity
    env["PYTHONPATH"] = python_path()
    env["GLOO_SOCKET_IFNAME"] = hosts.interface
    env["OMP_NUM_THREADS"] = "1"
    log = out / f"node{node}.log"
    command = [
        *hosts.exec_prefix(node),
        sys.executable,
        "-m",
        "torch.distributed.run",
        # underscore spellings: torch 2.0's torchrun knows only those, newer ones accept both
        "--nnodes=2",
        "--nproc_per_node=2",
        f"--node_rank={node}",
        f"--master_addr={hosts.addresses[0]}",  # static rendezvous, hosted by node 0's agent
        f"--master_port={MASTER_PORT}",
        "--rdzv_conf=timeout=60",  # how long an agent waits for the other node to join
        "--max_restarts=0",
        "--monitor_interval=0.2",  # torch < 2.5 polls its workers every 5 s by default
        f"--log_dir={out / f'logs{node}'}",
        "--redirects=3",
        "--tee=3",  # every rank's stdout/stderr in its log file and in the agent's console log
        str(SCRIPT),
        f"--out={out}",
        *job_args,
    ]
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return proc, log


def _logs(out: Path) -> str:
    """Both agents' console logs and every rank's log files, for assertion messages."""
    parts = []
    for path in sorted(out.glob("node*.log")) + sorted(out.glob("logs*/**/*")):
        if path.is_file() and path.stat().st_size:
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.relative_to(out)}\n{text[-6000:]}")
    return "\n".join(parts) or "(no output)"


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[float | None]:
    """Wait for every process (up to ``timeout`` s in total); return the wall-clock time each exited at."""
    exited: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and None in exited:
        for i, proc in enumerate(procs):
            if exited[i] is None and proc.poll() is not None:
                exited[i] = time.time()
        time.sleep(0.02)
    return exited


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------------- the job's results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("multinode")
    with _hosts() as hosts:  # removed on every way out of this block
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs = [_torchrun(hosts, node, out)[0] for node in (0, 1)]
            started = time.monotonic()
            exited = _wait_all(procs, JOB_TIMEOUT)
            elapsed = time.monotonic() - started
            codes = [p.poll() for p in procs]
            assert None not in exited, f"torchrun still running after {JOB_TIMEOUT:.0f} s\n{_logs(out)}"
            assert codes == [0, 0], f"torchrun exit codes {codes}\n{_logs(out)}"
            left = {name: _netns.pids_in(name) for name in hosts.names}
            assert not any(left.values()), f"processes left in the namespaces: {left}\n{_logs(out)}"
        finally:
            _stop(procs)
        print(f"two-node job: {elapsed:.1f} s from start to both agents' exit")
    # the namespaces are gone here; the results are files
    return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(job.WORLD)}


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``actual`` equals ``expected`` to :data:`RTOL` relative to the largest magnitude in ``expected``."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float64, what
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= RTOL * scale, f"{what}: max error {error:.3e} vs scale {scale:.3e}"


def reference(scope: str, kind: str, mode: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process (loss, gradient w.r.t. this rank's own input) for ``rank`` in one case."""
    group = job.members(scope, rank)
    me = group.index(rank)
    if kind == "gather":
        xs = [job.gather_input(g).requires_grad_() for g in group]
        losses = [job.gather_loss(xs, member) for member in range(len(group))]
    else:
        data = [job.metric_inputs(g) for g in group]
        xs = [preds.requires_grad_() for preds, _ in data]
        # MSE over every sample of the group: what both the sum-state and the cat-state metric compute
        mse = ((torch.cat(xs) - torch.cat([target for _, target in data])) ** 2).mean()
        losses = [mse] * len(group)  # every member computes the same synced loss
    target_loss = losses[me] if mode == "local" else sum(losses)  # local: own loss; global: every member's
    (grad,) = torch.autograd.grad(target_loss, xs[me])  # type: ignore[arg-type]
    return losses[me].detach(), grad


# ------------------------------------------------------------------------------------------- tests


def test_ranks_run_on_two_hosts_and_node_groups_renumber_them(results: dict[int, dict[str, Any]]) -> None:
    ids = {rank: results[rank]["identity"] for rank in range(job.WORLD)}
    own_netns = os.stat("/proc/self/ns/net").st_ino
    for rank, ident in ids.items():
        assert ident["rank"] == rank and ident["world_size"] == job.WORLD
        assert (ident["node_rank"], ident["local_rank"]) == divmod(rank, job.PER_NODE)
        assert ident["netns"] != own_netns, "a worker ran in the test's own network namespace"
        assert ident["netns"] == ids[rank // job.PER_NODE * job.PER_NODE]["netns"]
        assert ident["gloo_ifname"] == _netns.VETH
        # the node subgroup holds exactly this node's ranks, all in one namespace, numbered from 0
        assert ident["node_group_members"] == job.members("node", rank)
        assert ident["node_group_netns"] == [ident["netns"]] * job.PER_NODE
        assert ident["node_group_size"] == job.PER_NODE
        assert ident["node_group_rank"] == rank % job.PER_NODE
    assert ids[0]["netns"] != ids[job.PER_NODE]["netns"], "both nodes ran in one network namespace"
    # the point of the subgroup cases: there the group rank is not the global rank
    assert [r for r in ids if ids[r]["node_group_rank"] != r] == [2, 3]


@pytest.mark.parametrize(("scope", "kind", "mode"), job.CASES)
def test_every_rank_gets_the_single_process_gradient(
    results: dict[int, dict[str, Any]], scope: str, kind: str, mode: str
) -> None:
    for rank in range(job.WORLD):
        got = results[rank]["cases"][(scope, kind, mode)]
        expected_loss, expected_grad = reference(scope, kind, mode, rank)
        what = f"rank {rank}, {scope} group, {kind}, {mode} mode"
        assert got["mode_seen"] == mode, what
        # what ran: this package's code, except torchmetrics' own gather in local mode on torchmetrics >= 1.6
        native = results[rank]["identity"]["native"]
        assert got["installed"] == (kind == "gather" or mode == "global" or not native), what
        assert_rel(got["loss"], expected_loss, f"{what}: loss")
        assert_rel(got["grad"], expected_grad, f"{what}: gradient")
        if kind == "gather":  # every member's tensor, in group-rank order, bit for bit
            inputs = [job.gather_input(g) for g in job.members(scope, rank)]
            assert len(got["values"]) == len(inputs), what
            assert all(torch.equal(v, x) for v, x in zip(got["values"], inputs, strict=True)), what


def test_global_mode_differs_from_local_mode_by_the_group_size(results: dict[int, dict[str, Any]]) -> None:
    """The two modes are told apart by the data, not only by the references (synced metrics: factor = size)."""
    for rank in range(job.WORLD):
        for scope in job.SCOPES:
            size = len(job.members(scope, rank))
            for kind in ("sum", "cat"):
                local = results[rank]["cases"][(scope, kind, "local")]["grad"]
                glob = results[rank]["cases"][(scope, kind, "global")]["grad"]
                assert_rel(glob, size * local, f"rank {rank}, {scope}, {kind}")


def test_worker_death_on_second_node_ends_both_agents(tmp_path: Path) -> None:
    """Global rank 3 (node 1) SIGKILLs itself; both torchrun agents must exit non-zero, leaving nothing behind."""
    # children this test did not start (multiprocessing's resource tracker, once any test used spawn) do not count
    before = set(_children())
    with _hosts() as hosts:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs = [_torchrun(hosts, node, tmp_path, "--die-rank=3")[0] for node in (0, 1)]
            exited = _wait_all(procs, JOB_TIMEOUT)
            codes = [p.poll() for p in procs]
            assert None not in exited, f"an agent still ran after {JOB_TIMEOUT:.0f} s: {codes}\n{_logs(tmp_path)}"
            died_file = tmp_path / "died_at"
            assert died_file.exists(), f"rank 3 never got to die\n{_logs(tmp_path)}"
            died_at = float(died_file.read_text())
            took = [t - died_at for t in exited if t is not None]
            print(f"death detected: agents exited {took[0]:.2f} s and {took[1]:.2f} s after rank 3 died")
            assert all(code not in (0, None) for code in codes), f"agent exit codes {codes}\n{_logs(tmp_path)}"
            # node 1's agent saw its worker killed (not some other failure first)
            assert "SIGKILL" in (tmp_path / "node1.log").read_text(errors="replace"), _logs(tmp_path)
            assert max(took) < DEATH_BOUND, f"agents exited {took} s after the death\n{_logs(tmp_path)}"
            # nothing survives its agent: no worker inside either namespace, no child of this process
            left = {name: _netns.pids_in(name) for name in hosts.names}
            assert not any(left.values()), f"processes left in the namespaces: {left}\n{_logs(tmp_path)}"
            assert _children_gone(5.0, before), f"child processes left: {set(_children()) - before}"
        finally:
            _stop(procs)


def _children_gone(within: float, existing: set[int]) -> bool:
    """Whether no live child but ``existing`` is left, waiting up to ``within`` seconds for exiting ones."""
    deadline = time.monotonic() + within
    while set(_children()) - existing and time.monotonic() < deadline:
        time.sleep(0.1)
    return not set(_children()) - existing


def _children() -> list[int]:
    """Live (not zombie) processes whose parent is this process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid():
            found.append(int(entry.name))
    return found
