"""The ``check`` command: run :mod:`torchmetrics_gradpatch.cli.checks` on spawned gloo ranks and print the table.

Ranks run through :func:`torchmetrics_gradpatch.cli._ranks.run` (torch's ``start_processes`` with a deadline);
every rank's gradients are compared with the single-process reference computed here. What cannot run here
(versions refused, no loopback port, a rank that could not start) is exit 3; a run that outlives ``--timeout`` is
exit 1 and says how to give it more time (the statuses: :mod:`torchmetrics_gradpatch.cli.exit`). torch is
imported inside the functions, once the command runs.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from torchmetrics_gradpatch._version import installed_version
from torchmetrics_gradpatch.cli.exit import (
    EXIT_CANNOT_RUN,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    PROG,
    torchmetrics_refused,
    usage_error,
)


class _Progress:
    """A progress line on stderr while the ranks start and run (they take seconds to import torch)."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._done = threading.Event()
        self._start = time.monotonic()
        self._live = sys.stderr.isatty()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self._done.wait(0.5):
            sys.stderr.write(f"\r{self._text} {time.monotonic() - self._start:.0f} s")
            sys.stderr.flush()

    def __enter__(self) -> _Progress:
        sys.stderr.write(f"{self._text}" + ("" if self._live else "\n"))
        sys.stderr.flush()
        if self._live:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._done.set()
        seconds = time.monotonic() - self._start
        if self._live:
            self._thread.join()
            outcome = "done in" if exc_type is None else "FAILED after"
            sys.stderr.write(f"\r{self._text} {outcome} {seconds:.1f} s\n")
        else:
            outcome = "ranks finished in" if exc_type is None else "ranks FAILED after"
            sys.stderr.write(f"{outcome} {seconds:.1f} s\n")
        sys.stderr.flush()


def _mode(state: dict[str, Any]) -> str:
    if state["applied_to"]:  # installed: any mode on torchmetrics < 1.6, global mode on native ones too
        return "patched (torchmetrics_gradpatch's gather is in force)"
    if state["native"]:
        return "native (this torchmetrics keeps the graph itself; nothing patched)"
    if state["graph_preserving"]:
        return "patched (torchmetrics_gradpatch's gather is in force)"
    return "NOT patched (TORCHMETRICS_GRADPATCH_AUTOPATCH=0 or unpatch()): torchmetrics' own gather"


def _sync(state: dict[str, Any]) -> str:
    if state.get("sync") == "fused":
        installed = any("'fused'" in where for where in state.get("sync_applied_to", ()))
        return "fused (two collectives per Metric sync)" + ("" if installed else ", NOT installed")
    return "torchmetrics (its own collectives)"


def _gradient_mode(state: dict[str, Any], world_size: int) -> str:
    mode = state.get("mode", "local")
    if mode == "global":
        return f"global (each rank receives every rank's loss gradient: {world_size} x the local-mode reference)"
    if mode == "off" and not state["native"]:
        return "off"
    return "local (each rank backpropagates through its own entry: torchmetrics 1.6 semantics)"


def _rows(table: Iterator[tuple[str, ...]]) -> list[str]:
    return [f"  {check:<44} {result:<6} {seconds:>9}{note}" for check, result, seconds, note in table]


def _cannot_listen(error: BaseException) -> bool:
    """Whether ``error`` is the rendezvous store failing to listen on loopback (no free port, EADDRINUSE)."""
    import torch.distributed as dist

    network_error = getattr(dist, "DistNetworkError", None)  # torch >= 2.1; torch 2.0 raises a RuntimeError
    text = str(error).lower()
    return (network_error is not None and isinstance(error, network_error)) or (
        isinstance(error, (OSError, RuntimeError)) and ("eaddrinuse" in text or "address already in use" in text)
    )


def _where_ranks_were(details: str) -> list[str]:
    """From a timed-out run's stack dumps: each pending rank and the innermost frame of the thread running it."""
    found: list[str] = []
    for part in details.split("--- rank ")[1:]:
        rank = "rank " + part.split(",")[0]
        for thread in part.split(" (most recent call first):")[1:]:
            frames = [line.strip() for line in thread.splitlines() if line.strip().startswith("File ")]
            if frames and any("rank_main" in frame for frame in frames):  # the rank's main thread
                found.append(f"  {rank} was at {frames[0]}")
                break
    return found


def _in_checks(details: str) -> bool:
    """Whether a failed run's stacks show a rank inside one check (``_checks._run_one``), not before them."""
    return "in _run_one" in details  # a traceback's "line N, in f" and faulthandler's "line N in f" alike


def _timed_out(args: argparse.Namespace, details: str, started: bool) -> list[str]:
    doing = "the ranks had started and were still running the checks" if started else "the ranks were still starting"
    lines = [f"{PROG}: check did not finish within --timeout {args.timeout:g} s: {doing}.", *_where_ranks_were(details)]
    hint = "Give it more time with --timeout SECONDS"
    if args.compile not in (None, "eager"):
        hint += f", or compile faster with --compile eager (backend {args.compile!r} can take minutes per check)"
    return [*lines, hint + "."]


def _spawn(args: argparse.Namespace, deadline: float, *, with_compile_support: bool = False) -> tuple[int, list[Any]]:
    """Run the checks on the ranks until ``deadline``: ``(EXIT_OK, results)``, or an exit status, said why."""
    from torchmetrics_gradpatch.cli import _ranks
    from torchmetrics_gradpatch.cli import checks as _checks

    world_size: int = args.world_size
    text = f"starting {world_size} gloo rank{'s' if world_size > 1 else ''} on loopback (each imports torch)..."
    if with_compile_support:
        text = "running the checks again with compile_support() on..."
    timeout = deadline - time.monotonic()
    if timeout <= 0:  # the first run used all of --timeout
        print("\n".join(_timed_out(args, "", started=False)), file=sys.stderr)
        return EXIT_CHECK_FAILED, []
    try:
        with _Progress(text):
            run_args = (args.mode, args.compile, with_compile_support, getattr(args, "sync", None))
            results = _ranks.run(_checks.rank_main, world_size, args=run_args, timeout=timeout)
    except _ranks.RankError as err:
        if err.reason == "timed out":
            print("\n".join(_timed_out(args, err.details, err.started)), file=sys.stderr)
            return EXIT_CHECK_FAILED, []
        if _in_checks(err.details):  # a rank crashed inside a check (rank_main reports what checks raise)
            print(f"{PROG}: check FAILED: rank {err.rank} {err.reason} while running the checks:", file=sys.stderr)
            print(err.details, file=sys.stderr)
            return EXIT_CHECK_FAILED, []
        print(f"{PROG}: cannot run here: rank {err.rank} {err.reason} before the checks could run.", file=sys.stderr)
        print(err.details, file=sys.stderr)
        return EXIT_CANNOT_RUN, []
    except Exception as err:
        if not _cannot_listen(err):
            raise
        print(
            f"{PROG}: cannot run here: the ranks' rendezvous cannot listen on a loopback port (127.0.0.1): "
            f"{str(err).splitlines()[0]}\nFree some local ports (every port of the ephemeral range seems taken) "
            "and run it again.",
            file=sys.stderr,
        )
        return EXIT_CANNOT_RUN, []
    return EXIT_OK, results


def _verdicts(results: list[Any], world_size: int, mode: str) -> dict[str, str | None]:
    """Each check's failure (see :func:`torchmetrics_gradpatch.cli.checks.failure`), or ``None`` when it passed."""
    from torchmetrics_gradpatch.cli import checks as _checks

    verdicts: dict[str, str | None] = {}
    for name in _checks.CHECKS:
        verdicts[name] = _checks.failure(name, [outcomes[name] for _, outcomes in results], world_size, mode)
    return verdicts


def run(args: argparse.Namespace) -> int:
    """The ``check`` command; returns the exit status."""
    if torchmetrics_refused():  # before the ranks start: each would refuse the same way, slower
        return EXIT_CANNOT_RUN

    from torchmetrics_gradpatch.cli import checks as _checks

    if args.compile is not None:
        offered = _checks.compile_backends()
        if args.compile not in offered:
            shown = ", ".join(name for name in offered if "TESTING_ONLY" not in name)
            return usage_error(
                f"argument --compile: torch {installed_version('torch')} has no backend {args.compile!r}; "
                f"choose one of: {shown}",
                "check",
            )
    deadline = time.monotonic() + args.timeout
    status, results = _spawn(args, deadline)
    if status != EXIT_OK:
        return status

    world_size: int = args.world_size
    state = results[0][0]
    mode = state.get("mode", "local")
    verdicts = _verdicts(results, world_size, mode)
    # Native torchmetrics under torch.compile: the run above was the user's program as it stands. If a check failed,
    # run again with compile_support() on, to say whether the program needs it (never switched on silently).
    native_compiled = args.compile is not None and state["native"]
    supported: dict[str, str | None] = {}
    if native_compiled and any(verdicts.values()):
        status, again = _spawn(args, deadline, with_compile_support=True)
        if status != EXIT_OK:
            return status
        supported = _verdicts(again, world_size, mode)
    lines = [
        f"torchmetrics-gradpatch check, {world_size} rank{'s' if world_size > 1 else ''} (gloo, loopback)",
        f"  torch         {state['torch_version']}",
        f"  torchmetrics  {state['torchmetrics_version']}",
        f"  gather        {_mode(state)}",
        f"  gradient mode {_gradient_mode(state, world_size)}",
        f"  sync          {_sync(state)}",
        *([f"  compiled      torch.compile(step, backend={args.compile!r})"] if args.compile else []),  # --compile
        "",
    ]
    failures: list[str] = []
    needs_support: list[str] = []  # checks that pass only with compile_support() (native torchmetrics, --compile)
    table = [("check", "result", "time", "")]
    for name, title in _checks.CHECKS.items():
        why, note = verdicts[name], ""
        if why is not None and name in supported and supported[name] is None:
            needs_support.append(f"  {title}, {why}")
            why, note = None, "  with compile_support() only"
        if why is not None:
            failures.append(f"  {title}, {why}")
        seconds = max(outcomes[name].seconds for _, outcomes in results)
        table.append((title, "pass" if why is None else "FAIL", f"{seconds * 1000:.1f} ms", note))
    lines += _rows(iter(table))
    passed_count = len(_checks.CHECKS) - len(failures)
    lines.append("")
    if not failures:
        lines.append(
            f"all {passed_count} checks passed: every rank's gradient matches the single-process reference"
            + (f" ({len(needs_support)} only with compile_support(), below)" if needs_support else "")
        )
    else:
        lines.append(f"{len(failures)} of {len(_checks.CHECKS)} checks FAILED:")
        lines += failures
        if not state["graph_preserving"]:
            lines.append(
                f"torchmetrics {state['torchmetrics_version']} drops the autograd graph in its gather; this is what "
                "the patch fixes (run without TORCHMETRICS_GRADPATCH_AUTOPATCH=0)."
            )
    if needs_support:
        lines += [
            f"needs compile_support(): on torchmetrics {state['torchmetrics_version']} your compiled Metric loss "
            "needs torchmetrics_gradpatch.compile_support() in your program; without it these fail inside "
            "torch.compile (with it they pass):",
            *needs_support,
        ]
    elif native_compiled and not failures:
        lines.append(
            f"compile_support() is not needed here: on torchmetrics {state['torchmetrics_version']} every check "
            "passed inside torch.compile without it."
        )
    print("\n".join(lines))
    return EXIT_OK if not failures else EXIT_CHECK_FAILED
