"""The command line's exit contract: every misuse is one message naming what was wrong and what is allowed.

0 success; 1 a check failed or did not finish within ``--timeout`` (saying how to give it more time); 2 a usage
error -- a bad argument or a bad ``TORCHMETRICS_GRADPATCH_*`` variable, in every command; 3 only "cannot run here"
(versions refused, no loopback port to listen on, a rank that could not start). Never a traceback. Every run is
the real CLI in a fresh interpreter; the occupied-ports case fills the ephemeral port range of a private network
namespace, so the rendezvous really meets EADDRINUSE.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from tests._rank_tools import dynamo_refusal
from tests._subprocess import cli, console_script, fake_torchmetrics, show

NATIVE = Version("1.6.0") <= Version(importlib.metadata.version("torchmetrics"))
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


# --- the run: timeouts are not "cannot run here" -------------------------------------------------------------------


@pytest.mark.waits
def test_a_run_that_times_out_while_the_ranks_start_says_so_and_how_to_give_more_time() -> None:
    proc = cli("check", "--timeout", "0.5")
    assert_one_message(proc, 1, "did not finish within --timeout 0.5 s", "still starting", "--timeout SECONDS")
    assert "cannot run here" not in proc.stderr and "could not" not in proc.stderr, show(proc)


# Imported by every rank (``sitecustomize`` on PYTHONPATH): the first check's collective never returns, so the ranks
# start and then stay inside the checks, however fast this machine compiles or gathers.
STALL_IN_THE_CHECKS = """
import os
if os.environ.get("TMGP_TEST_STALL") == "1":
    import time
    import torch.distributed as dist
    dist.all_gather = lambda *args, **kwargs: time.sleep(3600)
"""


@pytest.mark.waits
def test_a_run_that_times_out_in_the_checks_says_the_ranks_had_started(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(STALL_IN_THE_CHECKS)
    # The run waits out its whole timeout: 6 s is enough for two ranks to start on a quiet machine; on a loaded
    # one (a torch import can take 10 s) a run whose ranks were still starting is run again with room to spare.
    for timeout in ("6", "20"):
        proc = cli("check", "--timeout", timeout, env={"TMGP_TEST_STALL": "1"}, pythonpath=[str(tmp_path)])
        if "still starting" not in proc.stderr:
            break
    assert_one_message(proc, 1, f"did not finish within --timeout {timeout} s", "had started", "--timeout SECONDS")
    assert "rank 0 was at File" in proc.stderr and "rank 1 was at File" in proc.stderr, show(proc)
    assert "cannot run here" not in proc.stderr and "could not start" not in proc.stderr, show(proc)


@pytest.mark.parametrize(
    ("details", "status", "says"),
    [
        ('File "/x/checks.py", line 9 in _run_one\nprocess was killed by SIGSEGV', 1, "while running the checks"),
        ("process exited with code 1 without returning", 3, "cannot run here: rank 1 died before the checks"),
    ],
    ids=["inside-a-check", "before-the-checks"],
)
def test_a_rank_that_died_is_cannot_run_here_only_before_the_checks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], details: str, status: int, says: str
) -> None:
    """The runner's report decides: a rank that crashed inside a check failed it (1); one that never got there is 3."""
    from torchmetrics_gradpatch.cli import _ranks, main

    def dying_runner(*args: object, **kwargs: object) -> None:
        raise _ranks.RankError(1, "died", details)

    monkeypatch.setattr(_ranks, "run", dying_runner)
    assert main(["check"]) == status
    err = capsys.readouterr().err
    assert says in err and details in err, err


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


# --- check --compile on native torchmetrics: compile_support() is never switched on silently ------------------------


@pytest.mark.skipif(
    not NATIVE,
    reason="torchmetrics < 1.6: the trampoline is installed in local mode anyway, so check --compile has nothing to "
    "say about compile_support() (tests/test_compile.py's check runs assert that it says nothing)",
)
def test_check_compile_says_whether_a_compiled_metric_loss_needs_compile_support() -> None:
    refusal = dynamo_refusal()
    if refusal:
        pytest.skip(refusal)
    proc = cli("check", "--compile", timeout=900)
    assert proc.returncode == 0, show(proc)
    assert "compiled      torch.compile(step, backend='eager')" in proc.stdout, show(proc)
    assert "all 4 checks passed" in proc.stdout, show(proc)
    # torchmetrics >= 1.6: its own gather is traced, and gloo refuses the sum state's 0-d tensors (docs/design.md)
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("Metric loss, sum state"))
    assert row.rstrip().endswith("with compile_support() only"), show(proc)
    assert "needs compile_support()" in proc.stdout and "allgather" in proc.stdout, show(proc)


# --- the ranks check runs on: a named failure, a deadline, nothing left behind ----------------------------------------


def _raise_on_rank_one(pid_dir: str) -> int:
    import os

    import torch.distributed as dist

    Path(pid_dir, str(os.getpid())).write_text("")
    if dist.get_rank() == 1:
        raise ValueError("rank one's own error")
    dist.barrier()  # rank 0 waits for the rank that raised, as a peer in a collective would
    return 0


def _exit_without_returning(pid_dir: str) -> None:
    import os

    Path(pid_dir, str(os.getpid())).write_text("")
    os._exit(7)


def _sleep_in_the_body(pid_dir: str) -> None:
    import os
    import time

    Path(pid_dir, str(os.getpid())).write_text("")
    time.sleep(600)


@pytest.mark.parametrize(
    ("fn", "world_size", "timeout", "rank", "reason", "says"),
    [
        (_raise_on_rank_one, 2, 120.0, 1, "raised", "ValueError: rank one's own error"),
        (_exit_without_returning, 1, 120.0, 0, "died", "process exited with code 7"),
        (_sleep_in_the_body, 1, 8.0, 0, "timed out", "in _sleep_in_the_body"),
    ],
    ids=["raised", "died", "timed-out"],
)
def test_the_ranks_name_the_failing_rank_and_leave_no_process(
    tmp_path: Path, fn: Any, world_size: int, timeout: float, rank: int, reason: str, says: str
) -> None:
    """Fresh ranks by design: what is tested is how the command's own runner starts, fails and ends them."""
    from tests._procs import alive
    from torchmetrics_gradpatch.cli import _ranks

    with pytest.raises(_ranks.RankError) as caught:
        _ranks.run(fn, world_size, args=(str(tmp_path),), timeout=timeout)
    assert (caught.value.rank, caught.value.reason) == (rank, reason), caught.value
    assert says in caught.value.details, caught.value.details
    assert caught.value.started, caught.value  # every rank had joined the group before the body ran
    pids = [int(path.name) for path in tmp_path.iterdir()]
    assert len(pids) == world_size and not [pid for pid in pids if alive(pid)]
