"""Run pytest with a sync strategy in force in every process, and prove from a count which sync really ran.

    python tests/upstream/run.py upstream [tm1.5] --sync fused --mode global [-- pytest args]
    python tests/upstream/run.py suite --sync fused -- tests/test_fused.py ...

``upstream [LINE]``: upstream torchmetrics' ``unittests/bases/test_ddp.py`` of that line (vendored here; default:
the installed torchmetrics' line, which it must be in any case), from its
own directory as upstream runs it (1.5, 1.9: its pool of 2 gloo ranks, ``USE_PYTEST_POOL=1``; 0.11: 2 ranks per
test by ``torch.multiprocessing.spawn``, which starts them from a forkserver that imported torch once), with
``torchmetrics_gradpatch`` imported at the start of every process (``_hook/sitecustomize.py``), so its ranks,
whose code never imports the package, run patched in ``--mode`` with ``--sync``.

``suite``: the project's own tests, from the repository root, with ``TORCHMETRICS_GRADPATCH_SYNC`` set; they import
the package themselves and choose their gradient modes themselves (a test that names none expects local).

Either way every process counts the fused syncs it completes. With ``--sync fused`` at least 2 processes (the
ranks) must have run one, with ``--sync torchmetrics`` none may have: otherwise the run fails even if pytest passed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LINES = ("tm0.11", "tm1.5", "tm1.9")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["upstream", "suite"])
    parser.add_argument("line", nargs="?", choices=LINES, help="upstream: the line (default: the installed one's)")
    parser.add_argument("--sync", choices=["fused", "torchmetrics"], default="fused")
    parser.add_argument("--mode", choices=["local", "global"], help="upstream: the gradient mode (default local)")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1 :]  # everything after --: passed to pytest
    if args.what == "suite" and (args.line or args.mode):
        parser.error("suite takes no line and no --mode: the suite's tests choose their gradient modes")
    return args


def check_line(line: str | None) -> str:
    """``line``, or the installed torchmetrics' line; exits if that is not the installed one or not vendored."""
    installed = importlib.metadata.version("torchmetrics")
    own = "tm" + ".".join(installed.split(".")[:2])
    if own not in LINES:
        sys.exit(f"run.py: no upstream tests vendored for torchmetrics {installed} (only {', '.join(LINES)})")
    if line not in (None, own):
        sys.exit(f"run.py: {line}'s tests need torchmetrics {line.removeprefix('tm')}.x; this one has {installed}")
    return own


def counts(probe: Path) -> tuple[dict[str, int], set[str]]:
    """Fused syncs completed per process id, and the gradient modes they ran in."""
    lines = {path.name: path.read_text().split() for path in sorted(probe.iterdir())}
    return {pid: len(modes) for pid, modes in lines.items()}, {mode for modes in lines.values() for mode in modes}


def free_port_block(size: int) -> int:
    """The first of ``size`` consecutive ports free on localhost now, below Linux's ephemeral range (32768 on), so
    that neither another run's rendezvous nor an outgoing connection is likely to take one before upstream does."""
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(20000, 32768 - size)
        sockets = []
        try:
            for port in range(start, start + size):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return start
    raise RuntimeError(f"no {size} consecutive free ports found in 20000-32767 on localhost")


def main(argv: list[str]) -> int:
    args = parse(argv)
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHMETRICS_GRADPATCH_")}
    env["TORCHMETRICS_GRADPATCH_SYNC"] = args.sync
    if args.what == "upstream":
        args.line = check_line(args.line)
        cwd = HERE / args.line
        env["TORCHMETRICS_GRADPATCH_MODE"] = args.mode or "local"
        env["TMGP_IMPORT_PACKAGE"] = "1"
        env["USE_PYTEST_POOL"] = "1"
        env["TMGP_UPSTREAM_START_PORT"] = str(free_port_block(13))
        if args.line == "tm0.11":  # it spawns 2 fresh ranks per test: they start from a forkserver (_hook/)
            env["TMGP_SPAWN_FORKSERVER"] = "1"
        command = [sys.executable, "-m", "pytest", "unittests/bases/test_ddp.py", "-q", *args.pytest_args]
    else:
        cwd = ROOT
        command = [sys.executable, "-m", "pytest", *args.pytest_args]
    with tempfile.TemporaryDirectory(prefix="tmgp-fused-probe-") as probe:
        env["TMGP_FUSED_PROBE"] = probe
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "_hook"), os.environ.get("PYTHONPATH")]))
        mode = env.get("TORCHMETRICS_GRADPATCH_MODE", "per test")
        what = f"{args.what}{' ' + args.line if args.line else ''} sync={args.sync} mode={mode}"
        print(f"run.py: {what}: {' '.join(command)} (in {cwd})", flush=True)
        status = subprocess.call(command, cwd=cwd, env=env)
        per_process, modes = counts(Path(probe))
    total = sum(per_process.values())
    in_modes = f" (modes: {', '.join(sorted(modes))})" if modes else ""
    print(f"run.py: {what}: pytest exit {status}; {total} fused syncs in {len(per_process)} processes{in_modes}")
    if args.sync == "fused" and len(per_process) < 2:
        print("run.py: FAILED: fewer than 2 processes ran a fused sync: the fused path was not taken", flush=True)
        return status or 1
    if args.mode and modes - {args.mode}:
        print(f"run.py: FAILED: fused syncs ran in mode(s) {sorted(modes - {args.mode})}, not {args.mode}", flush=True)
        return status or 1
    if args.sync == "torchmetrics" and total:
        print("run.py: FAILED: fused syncs ran although torchmetrics' own sync was asked for", flush=True)
        return status or 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
