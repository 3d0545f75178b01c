"""Rank functions for the reliability tests (property, stress, fault and port tests).

Every function here runs inside a rank spawned by :func:`torchmetrics_gradpatch.testing.spawn_ranks`, so it
must be module-level in an importable module. Whatever a rank does, every rank of the world must issue the
same collectives in the same order; the comments say how each function keeps to that.
"""

from __future__ import annotations

import os
import random
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torchmetrics.utilities.distributed as tm_dist

from tests._rank_tools import errors_off_and_on

#: dtypes gloo can all-gather (int16, uint16/32/64 and float8 raise "Invalid scalar type" on gloo).
DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
)
GRAD_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "complex64", "complex128"})


def all_empty_gathers() -> int:
    """Probe, with torchmetrics' own (unpatched) gather: gathers in which every rank's tensor is empty.

    Older gloo cannot do them, patched or not: torch 2.0.1 dies of SIGFPE, 2.1.2-2.4.1 desync the ranks
    ("Connection closed by peer"); 2.13.0 and 2.15.0 handle them. The test runs this in a throwaway spawn
    first and, where it fails, the property test does not draw such gathers.
    """
    import torchmetrics_gradpatch

    torchmetrics_gradpatch.unpatch()
    rank = dist.get_rank()
    done = 0
    for shape in [(0, 3), (0, 2 + 4 * rank, 0), (0,)]:
        for _ in range(2):
            tm_dist.gather_all_tensors(torch.zeros(shape))
            done += 1
    return done


def gloo_dtypes() -> tuple[str, ...]:
    """The :data:`DTYPES` this torch's gloo can all-gather, probed with one tiny all_gather each.

    gloo refuses a dtype it lacks ("Invalid scalar type") on every rank alike, before any data moves: bfloat16
    on torch 2.0 and 2.1, bool on 2.0. Any other error is real and propagates.
    """
    usable = []
    for name in DTYPES:
        probe = torch.zeros(1, dtype=getattr(torch, name))
        try:
            dist.all_gather([torch.zeros_like(probe) for _ in range(dist.get_world_size())], probe)
        except RuntimeError as err:
            if "Invalid scalar type" not in str(err):
                raise
            continue
        usable.append(name)
    return tuple(usable)


# --------------------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------------------


def torchmetrics_gather() -> Any:
    """torchmetrics' own function object (runs the patched code while the patch is in force)."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    return gather_all_tensors


def unpatched_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """torchmetrics' gather with the patch off (its original code runs). Leaves the patch off."""
    import torchmetrics_gradpatch as tmgp

    tmgp.unpatch()
    assert not tmgp.is_patched()
    with warnings.catch_warnings():  # torchmetrics < 1.6 on torch >= 2.8 warns at every uneven gather
        warnings.simplefilter("ignore")
        return list(torchmetrics_gather()(tensor, group))


def patched_gather(tensor: torch.Tensor, group: Any = None, mode: str = "local") -> list[torch.Tensor]:
    """torchmetrics' gather inside a ``patched(mode=mode)`` block (every rank must use the same mode)."""
    import torchmetrics_gradpatch as tmgp
    from torchmetrics_gradpatch import _engine

    with tmgp.patched(mode=mode), warnings.catch_warnings():
        if not _engine.installed():
            raise AssertionError(f"patched(mode={mode!r}) installed nothing: patched and unpatched would be the same")
        warnings.simplefilter("error")  # the patched gather must not warn
        return list(torchmetrics_gather()(tensor, group))


def as_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes, for bit-for-bit comparison (NaN payloads and -0.0 included)."""
    if tensor.numel() == 0:
        return b""
    flat = tensor.detach().reshape(-1)
    flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)  # stride 1 even for a size-1 strided view
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and as_bytes(a) == as_bytes(b)


# --------------------------------------------------------------------------------------------------------------
# Property tests: hypothesis runs inside every rank, derandomized, so all ranks draw the same examples
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One drawn case. Every rank draws the same one and picks its own shape by rank."""

    shapes: tuple[tuple[int, ...], ...]  # one per global rank (ranks outside the group ignore theirs)
    dtype: str
    requires_grad: bool
    contiguous: bool
    no_grad: bool
    subgroup: bool  # gather over the group of ranks 1..world-1 instead of the world
    seed: int

    def digest(self) -> int:
        return zlib.crc32(repr(self).encode()) & 0x7FFFFFFF


def make_tensor(shape: tuple[int, ...], dtype_name: str, seed: int, contiguous: bool) -> torch.Tensor:
    """A deterministic tensor (any rank can rebuild any other rank's), with NaN/inf/-0.0 among floats.

    The values depend on ``shape``, ``dtype_name`` and ``seed`` only; ``contiguous=False`` lays the same values
    out as a transposed (ndim >= 2) or every-other-element (ndim 1) view.
    """
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        values = torch.randn(shape, generator=gen, dtype=dtype) * 100
    elif dtype.is_floating_point:
        values = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1000).to(dtype)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
        flat = values.reshape(-1)
        if flat.numel():
            where = torch.randint(0, flat.numel(), (min(4, flat.numel()),), generator=gen)
            flat[where] = specials[: len(where)]
    elif dtype == torch.bool:
        values = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        values = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen).to(dtype)
    if contiguous or len(shape) == 0:
        return values
    if len(shape) == 1:
        storage = torch.zeros(shape[0] * 2, dtype=dtype)
        view = storage[::2]
    else:
        view = torch.zeros((*shape[:-2], shape[-1], shape[-2]), dtype=dtype).transpose(-1, -2)
    view.copy_(values)
    return view


def check_example(example: Example, subgroup: Any, mode: str = "local") -> list[str]:
    """Run one example on this rank; return the problems found (empty when all is well).

    ``mode="local"``: upstream 1.6 semantics, only the local entry carries a graph and it is the caller's tensor.
    ``mode="global"`` (every rank alike): the same values, every entry an output of the global node when the
    tensors require grad, and the gradient of rank ``j``'s tensor summed over the group's ranks.
    """
    glob = mode == "global"
    rank, world = dist.get_rank(), dist.get_world_size()
    members = list(range(1, world)) if example.subgroup else list(range(world))
    if rank not in members:
        return []
    group = subgroup if example.subgroup else None
    index = members.index(rank)  # the rank within the group: where the local entry must be
    problems: list[str] = []
    expected = [make_tensor(example.shapes[r], example.dtype, example.seed + r, True) for r in members]

    x = make_tensor(example.shapes[rank], example.dtype, example.seed + rank, example.contiguous)
    if example.requires_grad:
        x.requires_grad_(True)

    reference = unpatched_gather(x.detach(), group)
    if example.no_grad:
        with torch.no_grad():
            out = patched_gather(x, group, mode)
    else:
        out = patched_gather(x, group, mode)
    graph = example.requires_grad and not example.no_grad

    if len(out) != len(members):
        return [f"{len(out)} entries for a group of {len(members)}"]
    for i, (got, ref, want) in enumerate(zip(out, reference, expected, strict=True)):
        if i == index:
            continue
        if not same_bits(got, ref):
            problems.append(f"entry {i} differs from the unpatched gather: {got!r} vs {ref!r}")
        if not same_bits(got, want):
            problems.append(f"entry {i} differs from rank {members[i]}'s tensor")
        if got.requires_grad != (glob and graph):
            problems.append(f"entry {i} (not local) requires_grad is {got.requires_grad} in {mode} mode")
    local = out[index]
    if x.is_contiguous() and not glob:
        if local is not x:
            problems.append(f"local entry {index} is not the caller's tensor")
    elif not same_bits(local, x):
        problems.append(f"local entry {index} does not equal the caller's (non-contiguous) tensor")
    if not same_bits(reference[index], x.detach()):
        problems.append("the unpatched gather's own local entry differs from the caller's tensor")

    if example.requires_grad and not example.no_grad:
        # loss = sum_i (i + 1) * out[i].sum(). Local mode: only the local entry carries a graph, so d loss / d x is
        # index + 1. Global mode: every member's loss sends its (index + 1) back, so the group size times that.
        loss = sum(
            ((i + 1) * entry.real.sum() if entry.is_complex() else (i + 1) * entry.sum()) for i, entry in enumerate(out)
        )
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            problems.append("the loss has no graph")
        else:
            loss.backward()
            want = (len(members) if glob else 1) * (index + 1)
            want_grad = torch.full_like(x, want)
            if x.grad is None or not same_bits(x.grad, want_grad):
                problems.append(f"grad {x.grad!r}, expected {want} everywhere")
    return problems


def _consensus(example: Example, problems: list[str]) -> None:
    """Make every rank agree on the example and on its verdict, so all ranks raise (and shrink) together."""
    mine = torch.tensor([example.digest(), int(bool(problems))], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    digests = {int(t[0]) for t in every}
    if len(digests) != 1:
        raise RuntimeError(f"ranks drew different examples ({sorted(digests)}): the collectives would diverge")
    failed = [r for r, t in enumerate(every) if int(t[1])]
    if failed:
        raise AssertionError(f"ranks {failed} failed {example}; this rank: {problems or 'ok'}")


def run_properties(max_examples: int, empty_gathers_work: bool = True, mode: str = "local") -> dict[str, Any]:
    """Hypothesis inside the rank: derandomized, no database, so every rank runs the same examples in order.

    ``mode`` is the gradient mode of the patched side (the same on every rank).
    """
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    world = dist.get_world_size()
    subgroup = dist.new_group(list(range(1, world))) if world > 1 else None  # collective: every rank calls it
    seen: dict[str, int] = {"examples": 0, "uneven": 0, "zero_size": 0, "grad": 0, "subgroup": 0}
    dtypes = gloo_dtypes()

    @st.composite
    def examples(draw: Any) -> Example:
        ndim = draw(st.integers(0, 3))
        if ndim == 0:
            shapes: tuple[tuple[int, ...], ...] = ((),) * world
        elif draw(st.booleans()):
            shape = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
            shapes = (shape,) * world
        else:
            shapes = tuple(tuple(draw(st.integers(0, 6)) for _ in range(ndim)) for _ in range(world))
        if not empty_gathers_work:
            # The data all_gather moves the elementwise-largest shape of the group's members (the world, or the
            # subgroup of ranks 1..n-1); with a zero in it every member sends nothing.
            for members in (shapes, shapes[1:]):
                assume(not members or 0 not in [max(sizes) for sizes in zip(*members, strict=True)])
        dtype = draw(st.sampled_from(dtypes))
        return Example(
            shapes=shapes,
            dtype=dtype,
            requires_grad=dtype in GRAD_DTYPES and draw(st.booleans()),
            contiguous=draw(st.booleans()),
            no_grad=draw(st.booleans()),
            subgroup=world > 1 and draw(st.booleans()),
            seed=draw(st.integers(0, 2**20)),
        )

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(examples())
    def property_holds(example: Example) -> None:
        try:
            problems = check_example(example, subgroup, mode)
        except Exception as err:  # a local failure must still reach the consensus step
            problems = [f"raised {err!r}"]
        _consensus(example, problems)
        seen["examples"] += 1
        seen["uneven"] += len(set(example.shapes)) > 1
        seen["zero_size"] += any(0 in shape for shape in example.shapes)
        seen["grad"] += example.requires_grad and not example.no_grad
        seen["subgroup"] += example.subgroup

    property_holds()
    # While the group is up anyway: a non-tensor must give the unpatched gather's error (no collective runs).
    seen["non_tensor_problems"] = non_tensor_errors_match()  # type: ignore[assignment]
    seen["dtypes"] = list(dtypes)  # type: ignore[assignment]
    return seen


# --------------------------------------------------------------------------------------------------------------
# Stress: 8 threads toggle the patch while the main thread keeps gathering
# --------------------------------------------------------------------------------------------------------------


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
    import torchmetrics_gradpatch as tmgp
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
    gather = torchmetrics_gather()
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


# --------------------------------------------------------------------------------------------------------------
# Faults and ports
# --------------------------------------------------------------------------------------------------------------


class DeliberateError(Exception):
    """Raised on purpose by :func:`raise_on`."""


def raise_on(bad_rank: int, message: str) -> int:
    rank = dist.get_rank()
    if rank == bad_rank:
        raise DeliberateError(message)
    dist.barrier()  # the others wait in a collective the bad rank never joins
    return rank


def raise_on_alone(bad_rank: int, message: str) -> int:
    """The bad rank raises while the others are *not* inside a collective (they sleep, then return)."""
    rank = dist.get_rank()
    if rank == bad_rank:
        raise DeliberateError(message)
    time.sleep(5.0)
    return rank


def exit_on(bad_rank: int, code: int) -> int:
    rank = dist.get_rank()
    if rank == bad_rank:
        os._exit(code)
    dist.barrier()
    return rank


def exit_on_alone(bad_rank: int, code: int) -> int:
    """The bad rank exits while the others are *not* inside a collective (they sleep, then return)."""
    rank = dist.get_rank()
    if rank == bad_rank:
        os._exit(code)
    time.sleep(5.0)
    return rank


def kill_self_on(bad_rank: int) -> int:
    import signal

    rank = dist.get_rank()
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(5.0)  # not in a collective: see the xfail tests in test_faults.py for why
    return rank


def hang_on(bad_rank: int) -> int:
    rank = dist.get_rank()
    if rank == bad_rank:
        hang_here_forever()
    dist.barrier()
    return rank


def hang_here_forever() -> None:
    while True:
        time.sleep(0.2)


def non_tensor_errors_match() -> list[str]:
    """In an initialised group: a non-tensor gives the unpatched gather's error, on every rank."""
    problems = []
    for bad in (1.5, [1, 2], None, "x"):
        # every rank runs the same modes in the same order, so the ranks never disagree on the mode
        unpatched, *patched = errors_off_and_on(lambda: torchmetrics_gather()(bad))  # noqa: B023 (called at once)
        if not patched or any(error != unpatched for error in patched):
            problems.append(f"{bad!r}: unpatched {unpatched} vs patched {patched}")
    return problems


def port_check(tag: int) -> tuple[int, int, int, float]:
    """A real collective, so a crossed rendezvous (two runs sharing a port) would show up as a wrong sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(tag * 1000 + rank)])
    dist.all_reduce(value)
    return tag, rank, world, float(value)


def properties_catch_a_broken_gather(max_examples: int, mode: str = "local") -> str:
    """Run the property test against a gather that puts the local entry at the *global* rank (wrong in a
    subgroup, upstream's own pitfall); return the failure hypothesis reports, or ``"not caught"``."""
    from torchmetrics_gradpatch import _engine, _modes

    # what the trampoline dispatches to: the mode's gather in _modes.GATHERS, chosen at every state change
    correct = _modes.gather_for(mode)

    def broken(result: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        out: list[torch.Tensor] = correct(result, group)
        index = dist.get_rank()  # the bug: not dist.get_rank(group)
        if index < len(out):
            out[index] = result.contiguous()
        return out

    _modes.GATHERS[mode] = broken
    _engine.refresh()
    try:
        run_properties(max_examples, mode=mode)
    except AssertionError as err:
        return str(err)
    return "not caught"
