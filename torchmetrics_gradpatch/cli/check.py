"""The ``check`` command: :mod:`.checks` on spawned gloo ranks, the table of what they found, and its exit status.

The ranks start with ``torch.multiprocessing.start_processes`` and meet at a ``TCPStore`` hosted here on a port the
kernel chooses (port 0: no free-port race), where each leaves its result. At the deadline, ``--timeout``, each rank
still running is asked for its Python stacks (``faulthandler`` on SIGUSR1) and the report names it and shows them; a
rank that raises is shown with its traceback, one that dies with its exit status and any fatal-signal dump. Every
rank is killed and joined in a ``finally``: on success, failure, Ctrl-C and SIGTERM (which unwinds as Ctrl-C does).

Non-goals: this is no general rank supervisor. The ranks of a parent killed outright get torch's own
``PR_SET_PDEATHSIG`` (SIGINT), no process groups; a process a rank starts must end with it (inductor's compile
workers watch their parent).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import tempfile
import time
from typing import Any

import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, start_processes

from torchmetrics_gradpatch.cli import checks
from torchmetrics_gradpatch.cli.exit import EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_OK, PROG

HOST = "127.0.0.1"


class _RunError(Exception):
    """The run gave no results: ``args`` are the exit status and the message to print."""


def _stacks(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.stacks")


def _rank(rank: int, world_size: int, port: int, workdir: str, run_args: tuple[Any, ...]) -> None:
    """One rank: dump its stacks on SIGUSR1, join the group, run the checks, leave the result in the store."""
    stacks = open(_stacks(workdir, rank) + ".part", "w")  # noqa: SIM115 -- open for faulthandler until the end
    faulthandler.enable(stacks)  # a fatal signal's dump goes there too
    faulthandler.register(signal.SIGUSR1, stacks)
    os.rename(stacks.name, _stacks(workdir, rank))  # the name appears once SIGUSR1 dumps rather than kills
    store = dist.TCPStore(HOST, port, world_size, False)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()  # gloo may return from init on one rank while a peer still connects
    store.add("joined", 1)
    store.set(f"result{rank}", pickle.dumps(checks.rank_main(*run_args)))  # type: ignore[arg-type]
    store.add(f"done{rank}", 1)  # a counter the parent can read on every torch (TCPStore.check is 2.1 and newer)
    # Wait to be killed: leaving would only tear gloo down, which can hang (torch 2.0 to 2.4) or abort noisily (2.13
    # to 2.15). A parent killed outright ends the wait with torch's PR_SET_PDEATHSIG (SIGINT).
    while True:
        signal.pause()


def _run(args: argparse.Namespace, deadline: float, with_compile_support: bool = False) -> list[Any]:
    """Every rank's result in rank order, or :class:`_RunError`; no rank is left running either way."""
    try:
        store = dist.TCPStore(HOST, 0, args.world_size, True, wait_for_workers=False)  # type: ignore[attr-defined]
    except (RuntimeError, OSError) as error:  # torch's DistNetworkError is a RuntimeError
        raise _RunError(
            EXIT_CANNOT_RUN,
            f"cannot run here: the ranks' rendezvous cannot listen on a loopback port ({HOST}): "
            f"{str(error).splitlines()[0]}\nFree some local ports and run it again.",
        ) from None
    keys = [f"result{rank}" for rank in range(args.world_size)]

    def pending() -> list[int]:
        return [rank for rank in range(args.world_size) if not int(store.add(f"done{rank}", 0))]

    run_args = (args.mode, args.sync, args.compile, with_compile_support)
    with tempfile.TemporaryDirectory(prefix="tmgp-check-") as workdir:
        rank_args = (args.world_size, store.port, workdir, run_args)
        context = start_processes(_rank, rank_args, args.world_size, join=False)  # type: ignore[no-untyped-call]
        try:
            while pending():
                if time.monotonic() >= deadline:
                    raise _timed_out(args, context, store, workdir, pending())
                try:
                    finished = context.join(timeout=0.1)  # torch ends the other ranks when one fails
                except ProcessRaisedException as error:  # its traceback follows torch's heading
                    details = str(error).split("the following error:\n", 1)[-1]
                    raise _rank_failed(error.error_index, "raised", details.strip(), args, store) from None
                except ProcessExitedException as error:  # how it ended, and faulthandler's dump of a fatal signal
                    details = f"{error}\n{_read(_stacks(workdir, error.error_index))}".strip()
                    raise _rank_failed(error.error_index, "died", details, args, store) from None
                if finished and pending():  # every rank exited 0, one before leaving its result
                    raise _rank_failed(pending()[0], "died", "it exited without its result", args, store)
            return [pickle.loads(store.get(key)) for key in keys]
        finally:
            for proc in context.processes:  # SIGKILL, which nothing a rank runs can delay; one reaped is not signalled
                proc.kill()
                proc.join()
            for path in getattr(context, "error_files", ()):  # torch >= 2.2 leaves a raised rank's traceback file
                with contextlib.suppress(OSError, TypeError):
                    os.unlink(path)


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as file:
        return file.read().strip()
    return ""


def _timed_out(args: argparse.Namespace, context: Any, store: Any, workdir: str, pending: list[int]) -> _RunError:
    """Ask each rank still running (``pending``) for its Python stacks; the report names each one and shows them."""
    for rank in pending:  # one without its stacks file has no handler yet: SIGUSR1 would kill it
        if context.processes[rank].is_alive() and os.path.exists(_stacks(workdir, rank)):
            os.kill(context.processes[rank].pid, signal.SIGUSR1)
    time.sleep(0.5)  # faulthandler writes from its signal handler, at once
    started = int(store.add("joined", 0)) == args.world_size
    doing = "the ranks had started and were still running the checks" if started else "the ranks were still starting"
    lines = [f"check did not finish within --timeout {args.timeout:g} s: {doing}."]
    for rank in pending:
        stack = _read(_stacks(workdir, rank)) or "(none: the rank was still starting)"
        lines.append(f"--- rank {rank} was still running; its Python stack:\n{stack}")
    hint = "Give it more time with --timeout SECONDS"
    if args.compile not in (None, "eager"):
        hint += f", or compile faster with --compile eager (backend {args.compile!r} can take minutes per check)"
    return _RunError(EXIT_FAILED, "\n".join([*lines, hint + "."]))


def _rank_failed(rank: int, what: str, details: str, args: argparse.Namespace, store: Any) -> _RunError:
    """A failed rank's report: exit 1 when every rank had joined (the checks were running), else 3."""
    if int(store.add("joined", 0)) == args.world_size:
        return _RunError(EXIT_FAILED, f"check FAILED: rank {rank} {what} while running the checks:\n{details}")
    return _RunError(EXIT_CANNOT_RUN, f"cannot run here: rank {rank} {what} before the checks could run:\n{details}")


def check(args: argparse.Namespace) -> int:
    """The ``check`` command: run the checks on the ranks and print the table; its exit status."""
    print(
        f"starting {args.world_size} gloo rank{'s' * (args.world_size > 1)} on loopback (each imports torch)...",
        file=sys.stderr,
    )
    start = time.monotonic()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the ranks as Ctrl-C does
    try:
        results = _run(args, start + args.timeout)
        verdicts = {name: checks.failure(name, results) for name in checks.CHECKS}
        supported: dict[str, str | None] = {}
        # Native torchmetrics under torch.compile: the run above was the program as it stands. If a check failed,
        # run again with compile_support() on, to say whether the program needs it (never switched on silently).
        if args.compile and results[0][0]["native"] and any(verdicts.values()):
            print("running the checks again with compile_support() on...", file=sys.stderr)
            again = _run(args, start + args.timeout, with_compile_support=True)
            supported = {name: checks.failure(name, again) for name in checks.CHECKS}
    except _RunError as error:
        status, message = error.args
        print(f"{PROG}: {message}", file=sys.stderr)
        return int(status)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; every rank has been ended", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"ranks finished in {time.monotonic() - start:.1f} s", file=sys.stderr)
    report, passed = _report(args, results, verdicts, supported)
    print("\n".join(report))
    return EXIT_OK if passed else EXIT_FAILED


def _report(
    args: argparse.Namespace, results: list[Any], verdicts: dict[str, Any], supported: dict[str, Any]
) -> tuple[list[str], bool]:
    """The table printed on stdout, and whether every check passed."""
    state, tm = results[0][0], f"torchmetrics {results[0][0]['torchmetrics_version']}"
    if state["applied_to"]:
        gather = "patched (torchmetrics_gradpatch's gather is in force)"
    elif state["native"]:
        gather = "native (this torchmetrics keeps the graph itself; nothing patched)"
    else:
        gather = "NOT patched (TORCHMETRICS_GRADPATCH_AUTOPATCH=0 or unpatch()): torchmetrics' own gather"
    if state["mode"] == "global":
        mode = f"global (each rank receives every rank's loss gradient: {args.world_size} x the local-mode reference)"
    elif state["mode"] == "off" and not state["native"]:
        mode = "off"
    else:
        mode = "local (each rank backpropagates through its own entry: torchmetrics 1.6 semantics)"
    sync = {"fused": "fused (one exchange per Metric sync)"}.get(state["sync"], "torchmetrics (its own collectives)")
    lines = [
        f"{PROG} check, {args.world_size} rank{'s' * (args.world_size > 1)} (gloo, loopback)",
        f"  torch         {state['torch_version']}",
        f"  torchmetrics  {state['torchmetrics_version']}",
        f"  gather        {gather}",
        f"  gradient mode {mode}",
        f"  sync          {sync}",
        *([f"  compiled      torch.compile(step, backend={args.compile!r})"] if args.compile else []),
        "",
        f"  {'check':<44} {'result':<6} {'time':>9}",
    ]
    failures, needs_support = [], []  # the second: checks that pass only with compile_support()
    for name, title in checks.CHECKS.items():
        why, note = verdicts[name], ""
        if why is not None and name in supported and supported[name] is None:
            needs_support.append(f"  {title}, {why}")
            why, note = None, "  with compile_support() only"
        if why is not None:
            failures.append(f"  {title}, {why}")
        seconds = max(found[name].seconds for _, found in results)
        lines.append(f"  {title:<44} {'pass' if why is None else 'FAIL':<6} {seconds * 1000:>6.1f} ms{note}")
    if failures:
        lines += ["", f"{len(failures)} of {len(checks.CHECKS)} checks FAILED:", *failures]
        if not state["graph_preserving"]:
            lines.append(
                f"{tm} drops the autograd graph in its gather; this is what the patch fixes (run without "
                "TORCHMETRICS_GRADPATCH_AUTOPATCH=0)."
            )
    else:
        also = f" ({len(needs_support)} only with compile_support(), below)" if needs_support else ""
        lines += [
            "",
            f"all {len(checks.CHECKS)} checks passed: every rank's gradient matches the single-process reference{also}",
        ]
    if needs_support:
        lines += [
            f"needs compile_support(): on {tm} your compiled Metric loss needs "
            "torchmetrics_gradpatch.compile_support() in your program; without it these fail inside "
            "torch.compile (with it they pass):",
            *needs_support,
        ]
    elif args.compile and state["native"] and not failures:
        lines.append(
            f"compile_support() is not needed here: on {tm} every check passed inside torch.compile without it."
        )
    return lines, not failures
