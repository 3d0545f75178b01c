"""Two throw-away network namespaces joined by a veth pair: two "hosts" on one machine, for multi-node tests.

:func:`two_hosts` creates them, yields a :class:`Hosts`, and on every way out (return, exception, and also
``atexit`` for the pytest run dying in between) kills whatever still runs inside and deletes them. Deleting a
namespace kills nothing (its processes keep it alive, unnamed), so :func:`remove` kills first, waits until
``ip netns pids`` is empty, then deletes. A run killed so hard that none of that ran (SIGKILL, or pytest-timeout's
``thread`` method, which ends the process with ``os._exit``) leaves namespaces named after a dead pid: the next
:func:`two_hosts` removes those first (:func:`remove_stale`).

The namespaces hold nothing but ``lo`` and the veth ends, so nothing sent inside can leave them.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Prefix of every namespace made here; the pid that made it follows, so stale ones can be told from live ones.
PREFIX = "tmgp"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-[ab]$")
#: The veth end's name in both namespaces (interface names are per namespace, so parallel runs do not clash).
VETH = "tmgp0"
# RFC 5737 TEST-NET-1 (192.0.2.0/24) is reserved for documentation: never assigned to a real host nor routed,
# so these addresses cannot shadow or reach anything real, even if a namespace were somehow connected. A /30
# holds exactly the two ends. Being per namespace, they do not clash between parallel runs either.
ADDRESSES = ("192.0.2.1", "192.0.2.2")
PREFIX_LEN = 30
IP_TIMEOUT = 20.0


class NamespacesUnavailableError(RuntimeError):
    """Network namespaces cannot be made here (no ``ip``, not root, or the kernel refused)."""


@dataclass(frozen=True)
class Hosts:
    """The two namespaces (``names[i]`` has address ``addresses[i]`` on interface :data:`VETH`)."""

    names: tuple[str, str]
    addresses: tuple[str, str] = ADDRESSES
    interface: str = VETH

    def exec_prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program inside namespace ``host`` (0 or 1).

        Where util-linux's ``setpriv`` exists, the program also gets SIGTERM when the process that started it
        dies (``ip netns exec`` and the program replace ``setpriv`` in place, and the parent-death signal
        survives those execs): a test process killed outright (SIGKILL, pytest-timeout's ``os._exit``) then
        still stops torchrun, which stops its workers, instead of leaving them to run on.
        """
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "TERM"] if setpriv else []
        return [*prefix, _ip(), "netns", "exec", self.names[host]]


def _ip() -> str:
    path = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)
    if path is None:
        raise NamespacesUnavailableError("no `ip` binary (iproute2) on PATH, /usr/sbin or /sbin")
    return path


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([_ip(), *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def check_available() -> None:
    """Raise :class:`NamespacesUnavailableError` with the reason if namespaces cannot be made here."""
    _ip()
    if os.geteuid() != 0:
        raise NamespacesUnavailableError(f"creating network namespaces needs root (euid is {os.geteuid()})")


def list_namespaces() -> list[str]:
    """Names of every network namespace ``ip netns`` knows (its output is ``NAME [(id: N)]`` per line)."""
    proc = _run("netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def pids_in(name: str) -> list[int]:
    """Pids of the processes inside namespace ``name`` (empty if it does not exist)."""
    proc = _run("netns", "pids", name, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def remove(name: str, wait: float = 10.0) -> list[int]:
    """SIGKILL every process inside ``name``, wait until none is left, delete it. Returns the pids it killed.

    Idempotent; never raises for a namespace that is already gone.
    """
    killed: list[int] = []
    deadline = time.monotonic() + wait
    while (pids := pids_in(name)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.05)
    if name in list_namespaces():
        _run("netns", "delete", name, check=False)
    return killed


def remove_stale() -> list[str]:
    """Remove namespaces this module made in processes that no longer exist; return their names."""
    stale = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            remove(name)
            stale.append(name)
    return stale


def _create(names: tuple[str, str]) -> None:
    for name in names:
        proc = _run("netns", "add", name, check=False)
        if proc.returncode != 0:
            message = proc.stderr.strip()
            if "ermission" in message or "not permitted" in message:
                raise NamespacesUnavailableError(f"`ip netns add` was refused: {message}")
            raise RuntimeError(f"`ip netns add {name}` exited {proc.returncode}: {message}")
    # Both ends are created directly inside the namespaces (never in the host's), so their name is free to use.
    _run("-n", names[0], "link", "add", VETH, "type", "veth", "peer", "name", VETH, "netns", names[1])
    for name, address in zip(names, ADDRESSES, strict=True):
        # No IPv6 link-local address: the only address on the interface is the one gloo must bind to.
        _run("-n", name, "link", "set", VETH, "addrgenmode", "none")
        _run("-n", name, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", VETH)
        _run("-n", name, "link", "set", "lo", "up")
        _run("-n", name, "link", "set", VETH, "up")


@contextmanager
def two_hosts() -> Iterator[Hosts]:
    """Create two namespaces joined by a veth pair; remove them (and everything in them) on every way out."""
    check_available()
    remove_stale()
    token = uuid.uuid4().hex[:6]
    names = (f"{PREFIX}-{os.getpid()}-{token}-a", f"{PREFIX}-{os.getpid()}-{token}-b")

    def cleanup() -> None:
        for name in names:
            remove(name)

    atexit.register(cleanup)  # the pytest process dying between here and the finally below
    try:
        _create(names)
        yield Hosts(names)
    finally:
        cleanup()
        atexit.unregister(cleanup)
