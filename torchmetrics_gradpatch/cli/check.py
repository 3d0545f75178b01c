"""The ``check`` command: :mod:`.checks` on spawned gloo ranks (:mod:`.ranks`), the table of what they found, and its
exit status. Every rank is ended on success, failure, Ctrl-C and SIGTERM (which unwinds as Ctrl-C does)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from torchmetrics_gradpatch.cli import checks, ranks
from torchmetrics_gradpatch.cli.exit import EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_OK, PROG


def check(args: argparse.Namespace) -> int:
    """The ``check`` command: run the checks on the ranks and print the table; its exit status."""
    print(
        f"starting {args.world_size} gloo rank{'s' * (args.world_size > 1)} on loopback (each imports torch)...",
        file=sys.stderr,
    )
    start = time.monotonic()

    def run(with_compile_support: bool = False) -> list[Any]:
        run_args = (args.mode, args.sync, args.compile, with_compile_support)
        return ranks.run(checks.rank_main, args.world_size, run_args, timeout=start + args.timeout - time.monotonic())

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the ranks as Ctrl-C does
    try:
        results = run()
        verdicts = {name: checks.failure(name, results) for name in checks.CHECKS}
        supported: dict[str, str | None] = {}
        # Native torchmetrics under torch.compile: the run above was the program as it stands. If a check failed,
        # run again with compile_support() on, to say whether the program needs it (never switched on silently).
        if args.compile and results[0][0]["native"] and any(verdicts.values()):
            print("running the checks again with compile_support() on...", file=sys.stderr)
            again = run(with_compile_support=True)
            supported = {name: checks.failure(name, again) for name in checks.CHECKS}
    except (OSError, ranks.RanksError) as error:
        status, message = _failed(args, error)
        print(f"{PROG}: {message}", file=sys.stderr)
        return status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; every rank has been ended", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"ranks finished in {time.monotonic() - start:.1f} s", file=sys.stderr)
    report, passed = _report(args, results, verdicts, supported)
    print("\n".join(report))
    return EXIT_OK if passed else EXIT_FAILED


def _failed(args: argparse.Namespace, error: OSError | ranks.RanksError) -> tuple[int, str]:
    """A run without results: its exit status and message. A rank that raised or died fails the checks (1) once
    every rank had joined, else the check cannot run here (3)."""
    if isinstance(error, OSError):
        return EXIT_CANNOT_RUN, f"cannot run here: {error}\nFree some local ports and run it again."
    rank, (how, text) = next(iter(error.reports.items()))  # the first failure, if any
    if how != ranks.STILL and error.joined:
        return EXIT_FAILED, f"check FAILED: rank {rank} {how} while running the checks:\n{text}"
    if how != ranks.STILL:
        return EXIT_CANNOT_RUN, f"cannot run here: rank {rank} {how} before the checks could run:\n{text}"
    doing = "had started and were still running the checks" if error.joined else "were still starting"
    lines = [f"check did not finish within --timeout {args.timeout:g} s: the ranks {doing}."]
    lines += [f"--- rank {rank} {ranks.STILL}; its Python stack:\n{text}" for rank, (_, text) in error.reports.items()]
    hint = "Give it more time with --timeout SECONDS"
    if args.compile not in (None, "eager"):
        hint += f", or compile faster with --compile eager (backend {args.compile!r} can take minutes per check)"
    return EXIT_FAILED, "\n".join([*lines, hint + "."])


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
