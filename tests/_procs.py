"""Process checks shared by the tests of ranks and the CLI: whether a process is alive, read from ``/proc`` (not from a
runner's own bookkeeping), and a pytest run interrupted with SIGINT as a terminal would."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_once(command: list[str], cwd: Path, started: Callable[[], bool], wait: float = 120) -> tuple[int, str]:
    """Run ``command``; once ``started()`` is true, send SIGINT to it (not to its children); its status and output.

    SIGINT is set to its default in the child, as in a terminal: a suite started in the background by a
    non-interactive shell (nohup, ``cmd &``, some CI runners) inherits SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler at all.
    """
    proc = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_default_sigint
    )
    try:
        deadline = time.monotonic() + wait
        while not started() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert started(), "what was to be interrupted never started"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out
