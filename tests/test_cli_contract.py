"""The command line's exit contract: every misuse is one message naming what was wrong and what is allowed.

0 success; 1 a check failed or did not finish within ``--timeout`` (saying how to give it more time); 2 a usage
error -- a bad argument or a bad ``TORCHMETRICS_GRADPATCH_*`` variable, in every command; 3 only "cannot run here"
(versions refused, no loopback port to listen on, a rank that failed before the checks). Never a Python traceback
of the command itself: a rank's own traceback or stack is shown where it failed or hung. Every run is the real CLI
in a fresh interpreter. Faults reach the ranks from outside the package, through a ``sitecustomize`` module on
``PYTHONPATH``; the occupied-ports case fills the ephemeral port range of a private network namespace, so the
rendezvous really meets EADDRINUSE.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from packaging.version import Version

from tests._ranks import alive
from tests._subprocess import cli, console_script, fake_torchmetrics, python_path, show, suite_path

NATIVE = Version("1.6.0") <= Version(importlib.metadata.version("torchmetrics"))

pytestmark = pytest.mark.system
TORCH = importlib.metadata.version("torch")


def assert_one_message(proc: subprocess.CompletedProcess[str], status: int, *needles: str) -> None:
    """Exit ``status``, nothing on stdout, no traceback, and every needle in the message on stderr."""
    assert proc.returncode == status, show(proc)
    assert "Traceback" not in proc.stderr and proc.stdout == "", show(proc)
    for needle in needles:
        assert needle in proc.stderr, f"{needle!r} missing\n{show(proc)}"


# --- environment variables, in every command ---------------------------------------------------------------------

COMMANDS = [["status"], ["status", "--json"], ["check"], ["--version"]]
BAD_VARIABLES = {
    "TORCHMETRICS_GRADPATCH_MODE": ("foo", ["TORCHMETRICS_GRADPATCH_MODE='foo'", "local, global"]),
    "TORCHMETRICS_GRADPATCH_AUTOPATCH": ("maybe", ["TORCHMETRICS_GRADPATCH_AUTOPATCH='maybe'", "0, false", "1, true"]),
    "TORCHMETRICS_GRADPATCH_CHECK": ("maybe", ["TORCHMETRICS_GRADPATCH_CHECK='maybe'", "0, false", "1, true"]),
}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("variable", sorted(BAD_VARIABLES))
def test_bad_environment_variable_is_a_usage_error_in_every_command(variable: str, command: list[str]) -> None:
    value, needles = BAD_VARIABLES[variable]
    proc = cli(*command, env={variable: value})
    assert_one_message(proc, 2, "torchmetrics-gradpatch: error: ", *needles)
    assert len(proc.stderr.strip().splitlines()) == 1, show(proc)
    assert "starting" not in proc.stderr, show(proc)  # refused before any rank was spawned


def test_bad_environment_variable_through_the_console_script(tmp_path: Path) -> None:
    proc = cli("status", env={"TORCHMETRICS_GRADPATCH_MODE": "Globl"}, command=console_script(tmp_path))
    assert_one_message(proc, 2, "torchmetrics-gradpatch: error: TORCHMETRICS_GRADPATCH_MODE='Globl'", "local, global")


def test_bad_environment_variable_still_raises_in_a_program() -> None:
    """Only the CLI turns it into exit 2: a program's import raises the ValueError naming the variable."""
    code = "import torchmetrics_gradpatch"
    proc = cli(command=[sys.executable, "-c", code], env={"TORCHMETRICS_GRADPATCH_MODE": "foo"})
    assert proc.returncode == 1 and "ValueError: TORCHMETRICS_GRADPATCH_MODE='foo'" in proc.stderr, show(proc)


# --- status ---------------------------------------------------------------------------------------------------------


def test_status_after_a_plain_import_credits_the_import_not_patch() -> None:
    """The CLI imports the package and never calls patch(): status must not say patch() put the patch in force."""
    text = cli("status")
    in_force = "in force:         nothing is needed in local mode" if NATIVE else "in force:         yes"
    assert text.returncode == 0 and in_force in text.stdout and "the import patched" in text.stdout, show(text)
    assert "patch() is on" not in text.stdout, show(text)
    data = json.loads(cli("status", "--json").stdout)
    assert data["in_force"] and data["mode_chosen_by"] != "patch()", data


# --- arguments ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-1", "abc", ""])
def test_timeout_refuses_what_is_not_a_positive_finite_number(value: str) -> None:
    proc = cli("check", f"--timeout={value}")  # "=": argparse would read a bare "-inf" as an option
    assert_one_message(proc, 2, "argument --timeout", "positive, finite number of seconds", repr(value))
    assert "starting" not in proc.stderr, show(proc)


def test_timeout_parses_every_positive_finite_number() -> None:
    from torchmetrics_gradpatch.cli import build_parser

    for text, seconds in [("1e12", 1e12), ("86401", 86401.0), ("1e-3", 0.001), ("120", 120.0), ("2.5", 2.5)]:
        assert build_parser().parse_args(["check", "--timeout", text]).timeout == seconds


def test_a_huge_timeout_runs_the_checks() -> None:
    """The harness waits in slices, so a far deadline cannot overflow its poll (1e12 s raised OverflowError).

    One rank: the wait is the same for any number (and one torch import fewer than the default two ranks).
    """
    proc = cli("check", "--timeout", "1e12", "--world-size", "1")
    assert proc.returncode == 0 and "all 4 checks passed" in proc.stdout, show(proc)


def test_world_size_refuses_what_is_not_a_positive_whole_number() -> None:
    for value in ("0", "-2", "1.5", "two"):
        assert_one_message(cli("check", f"--world-size={value}"), 2, "argument --world-size", "at least 1")


def test_mode_refuses_a_name_that_is_not_a_mode() -> None:
    assert_one_message(cli("check", "--mode", "both"), 2, "argument --mode", "'both'", "'local', 'global'")


def test_unknown_compile_backend_is_a_usage_error_naming_torchs_backends() -> None:
    proc = cli("check", "--compile", "no_such_backend")
    assert_one_message(proc, 2, "argument --compile", "'no_such_backend'", f"torch {TORCH}", "eager", "inductor")
    assert "starting" not in proc.stderr, show(proc)  # refused before any rank was spawned


def test_compile_defaults_to_the_eager_backend_and_takes_inductor_by_name() -> None:
    from torchmetrics_gradpatch.cli import build_parser

    assert build_parser().parse_args(["check", "--compile"]).compile == "eager"
    assert build_parser().parse_args(["check", "--compile", "inductor"]).compile == "inductor"
    assert build_parser().parse_args(["check"]).compile is None


# --- the run: a deadline, a named failure, nothing left behind ------------------------------------------------------

# Imported at start-up by every process with ``tmp_path`` first on PYTHONPATH; it acts only in the ranks the command
# spawns (``--multiprocessing-fork``), which write their pid into TMGP_TEST_PIDS. TMGP_TEST_FAULT chooses the fault:
# "raise" before joining the group, "crash" (SIGSEGV) or "stall" (sleep for an hour) in the first check's collective.
FAULTS = """
import os
import sys

fault = os.environ.get("TMGP_TEST_FAULT")
if fault and "--multiprocessing-fork" in sys.orig_argv:
    import signal
    import time
    from pathlib import Path

    import torch.distributed as dist

    Path(os.environ["TMGP_TEST_PIDS"], str(os.getpid())).touch()
    init_process_group, all_gather = dist.init_process_group, dist.all_gather

    def init_or_raise(*args, **kwargs):
        if fault == "raise":
            raise ValueError(f"rank {kwargs['rank']} cannot join")
        return init_process_group(*args, **kwargs)

    def gather(*args, **kwargs):
        if fault == "stall":
            time.sleep(3600)
        if fault == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        return all_gather(*args, **kwargs)

    dist.init_process_group, dist.all_gather = init_or_raise, gather
"""


def with_fault(tmp_path: Path, fault: str) -> tuple[dict[str, str], list[str], Path]:
    """``env`` and ``pythonpath`` for :func:`cli` that make its ranks meet ``fault``, and where their pids go."""
    (tmp_path / "sitecustomize.py").write_text(FAULTS)
    (tmp_path / "pids").mkdir()
    return {"TMGP_TEST_FAULT": fault, "TMGP_TEST_PIDS": str(tmp_path / "pids")}, [str(tmp_path)], tmp_path / "pids"


def assert_no_rank_left(pids: Path, world_size: int) -> None:
    """Every rank started (its pid written) and none is alive once the command has returned."""
    found = [int(path.name) for path in pids.iterdir()]
    assert len(found) == world_size, found
    assert not [pid for pid in found if alive(pid)], found


def test_a_run_that_times_out_while_the_ranks_start_says_so_and_how_to_give_more_time() -> None:
    proc = cli("check", "--timeout", "0.5")
    assert_one_message(proc, 1, "did not finish within --timeout 0.5 s", "still starting", "--timeout SECONDS")
    assert "cannot run here" not in proc.stderr and "could not" not in proc.stderr, show(proc)


def test_a_hung_rank_is_named_with_its_python_stack_and_ended(tmp_path: Path) -> None:
    env, pythonpath, pids = with_fault(tmp_path, "stall")
    # The run waits out its whole timeout: 10 s is enough for two ranks to start on a quiet machine; on a loaded
    # one (a torch import can take 10 s) a run whose ranks were still starting is run again with room to spare.
    for timeout in ("10", "40"):
        for pid_file in pids.iterdir():
            pid_file.unlink()
        proc = cli("check", "--timeout", timeout, env=env, pythonpath=pythonpath)
        if "still starting" not in proc.stderr:
            break
    assert_one_message(proc, 1, f"did not finish within --timeout {timeout} s", "had started", "--timeout SECONDS")
    for rank in (0, 1):  # each rank's own section shows where it hangs: in the stalled collective
        section = proc.stderr.split(f"--- rank {rank} was still running; its Python stack:\n", 1)[1]
        section = section.split("--- rank ", 1)[0]
        assert "(most recent call first):" in section, show(proc)
        assert f'File "{tmp_path / "sitecustomize.py"}", line ' in section and " in gather\n" in section, show(proc)
    assert "in _step" in proc.stderr and "in rank_main" in proc.stderr, show(proc)
    assert "cannot run here" not in proc.stderr, show(proc)
    assert_no_rank_left(pids, 2)


def test_a_rank_that_raises_before_the_checks_is_cannot_run_here_with_its_traceback(tmp_path: Path) -> None:
    env, pythonpath, pids = with_fault(tmp_path, "raise")
    proc = cli("check", "--world-size", "1", env=env, pythonpath=pythonpath)
    assert proc.returncode == 3 and proc.stdout == "", show(proc)
    assert "torchmetrics-gradpatch: cannot run here: rank 0 raised before the checks could run:" in proc.stderr
    assert "Traceback (most recent call last):" in proc.stderr, show(proc)
    assert "in init_or_raise" in proc.stderr and proc.stderr.rstrip().endswith("ValueError: rank 0 cannot join")
    assert_no_rank_left(pids, 1)


def test_a_rank_that_dies_in_a_check_fails_the_check_with_its_stack(tmp_path: Path) -> None:
    env, pythonpath, pids = with_fault(tmp_path, "crash")
    proc = cli("check", "--world-size", "1", env=env, pythonpath=pythonpath)
    assert proc.returncode == 1 and proc.stdout == "", show(proc)
    assert "check FAILED: rank 0 died while running the checks:\nprocess 0 terminated with signal SIGSEGV" in (
        proc.stderr
    ), show(proc)
    assert "Fatal Python error: Segmentation fault" in proc.stderr, show(proc)  # faulthandler's dump: the stack
    assert "in gather" in proc.stderr and "in _step" in proc.stderr, show(proc)
    assert_no_rank_left(pids, 1)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal, even where this suite inherited it ignored


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_and_sigterm_end_every_rank(tmp_path: Path, signum: signal.Signals) -> None:
    """The command alone is signalled (a terminal's Ctrl-C would reach the ranks too): it ends them itself."""
    env, pythonpath, pids = with_fault(tmp_path, "stall")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchmetrics_gradpatch", "check", "--timeout", "300"],
        env={**os.environ, **env, "PYTHONPATH": python_path(*pythonpath)},
        cwd=suite_path(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1)  # past the ranks' start-up, into their imports or the checks: either way they must go
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    assert "torchmetrics-gradpatch: interrupted; every rank has been ended" in err and "Traceback" not in err, err
    assert_no_rank_left(pids, 2)


# --- cannot run here --------------------------------------------------------------------------------------------

OCCUPY_AND_RUN = """
import socket, subprocess, sys
low, high = (int(port) for port in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
held = []
for port in range(low, high + 1):  # every port the kernel could hand out for port 0
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    held.append(sock)
sys.exit(subprocess.run([sys.executable, "-m", "torchmetrics_gradpatch", "check"]).returncode)
"""


def test_occupied_ports_are_cannot_run_here(tmp_path: Path) -> None:
    """In a private network namespace whose two ephemeral ports are both taken, the rendezvous cannot listen."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here (no unshare, or not permitted)")
    script = tmp_path / "occupy_and_run.py"
    script.write_text(textwrap.dedent(OCCUPY_AND_RUN))
    shell = (
        "ip link set lo up && echo '50000 50001' > /proc/sys/net/ipv4/ip_local_port_range && "
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))}"
    )
    proc = cli(command=[unshare, "--net", "sh", "-c", shell])
    # torch's own words differ by version ("address already in use", "failed to listen on any local network address")
    assert_one_message(proc, 3, "cannot run here", "loopback port", "Free some local ports")


def test_torchmetrics_below_0_11_is_cannot_run_here(tmp_path: Path) -> None:
    fake = fake_torchmetrics(tmp_path / "old", "0.10.3", signature="result, group=None")
    for command in (["check"], ["status"]):
        proc = cli(*command, pythonpath=[fake])
        assert_one_message(proc, 3, "cannot run with torch", "torchmetrics 0.10.3", "torchmetrics >= 0.11")
