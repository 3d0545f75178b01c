"""A warm pool's worker, inside its rank: join the group once, then run each test sent to it, as if fresh.

Before each test the worker takes the pytest process's ``os.environ``, working directory and ``sys.path``, puts
the torch, Python and NumPy random generators back to their state at pool start, torch's default dtype, grad
mode, deterministic-algorithms flags and anomaly detection (each set only if a test changed it: setting the
deterministic flag imports ``torch._inductor`` on recent torch, which a fresh rank never loads), one intra-op
thread, the ``warnings`` filters, and calls every registered reset (:data:`RESETS`). After a passing test it
forgets the modules the test imported from outside the installed packages and the standard library, and says
what the test left that only new processes can undo (the pool then retires).

Invariant: rank side only; imports :mod:`._rank` and the standard library, never the parent side, and never
the patch engine (the package's own reset is named by an import path, resolved here, in the rank).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing.connection
import os
import pickle
import random
import signal
import site
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness import _rank

__all__ = ["READY", "RESETS", "worker_main"]

#: Sent as a worker's reply to the pool's start: the worker joined its group and waits for tests.
READY = "ready"

#: What must be put back between pooled tests, as ``"module:function"``: each function takes no argument, brings
#: its state back to what a fresh import under the current ``os.environ`` gives, and returns ``None``, or changes
#: nothing and returns a sentence naming what it cannot undo. Called before each test (once the pytest
#: process's environment is in place) and after each passing test (a sentence retires the pool).
RESETS: tuple[str, ...] = ("torchmetrics_gradpatch._api:reset_for_tests",)


def _resolve(name: str) -> Callable[[], str | None]:
    module_name, _, function = name.partition(":")
    module = importlib.import_module(module_name)
    found = getattr(module, function, None)
    if not callable(found):
        raise LookupError(f"registered reset {name!r}: {module_name} has no function {function!r}")
    return found  # type: ignore[no-any-return]


def _installed_roots() -> tuple[str, ...]:
    """Where installed packages and the standard library live: modules from there stay imported between tests."""
    paths = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        paths.add(site.getusersitepackages())
    return tuple(str(Path(path).resolve()) + os.sep for path in paths if path)


def _torch_flags() -> tuple[Any, bool, bool, bool, bool]:
    import torch

    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
    )


def _set_torch_flags(flags: tuple[Any, bool, bool, bool, bool]) -> None:
    import torch

    dtype, grad, deterministic, warn_only, anomaly = flags
    now = _torch_flags()
    if now[0] != dtype:
        torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    if now[2:4] != (deterministic, warn_only):
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if now[4] != anomaly:
        torch.autograd.set_detect_anomaly(anomaly)
    torch.set_num_threads(1)


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def _group_count() -> int:
    """How many process groups this rank holds (-1 where this torch does not say)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    return len(world.pg_map) if world is not None else -1


@dataclass
class _Baseline:
    """A worker's state right after it joined its group, put back before each test and checked after it."""

    modules: frozenset[str]
    meta_path: list[Any]
    threads: frozenset[threading.Thread]
    warning_filters: list[Any]
    torch_rng: Any
    python_rng: Any
    numpy_rng: Any
    torch_flags: tuple[Any, bool, bool, bool, bool]
    group: Any
    groups: int
    roots: tuple[str, ...]
    resets: list[Callable[[], str | None]]

    @classmethod
    def capture(cls) -> _Baseline:
        import torch

        numpy = sys.modules.get("numpy")
        return cls(
            modules=frozenset(sys.modules),
            meta_path=list(sys.meta_path),
            threads=frozenset(threading.enumerate()),
            warning_filters=list(warnings.filters),
            torch_rng=torch.get_rng_state(),
            python_rng=random.getstate(),
            numpy_rng=None if numpy is None else numpy.random.get_state(),
            torch_flags=_torch_flags(),
            group=_default_group(),
            groups=_group_count(),
            roots=_installed_roots(),
            resets=[_resolve(name) for name in RESETS],
        )

    def apply(self, environ: dict[str, str], cwd: str, path: list[str]) -> None:
        """Before a test: the pytest process's environment, directory and path; this worker's start state."""
        import torch

        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
        importlib.invalidate_caches()  # files the pytest process wrote since the last test
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        _set_torch_flags(self.torch_flags)
        warnings.filters[:] = self.warning_filters  # type: ignore[index]  # typeshed: Sequence; it is a list
        getattr(warnings, "_filters_mutated", lambda: None)()  # drop the "already shown once" caches
        for reset in self.resets:
            left = reset()
            if left is not None:  # after() checked the last test, so only a broken reset gets here
                raise RuntimeError(f"the pool cannot run this test in a clean state: {left}")

    def after(self) -> str | None:
        """After a passing test: forget its modules; say what it left that only new processes can undo."""
        sys.meta_path[:] = self.meta_path
        added = sys.modules.keys() - self.modules
        for name in [name for name in added if self._forget(name, added)]:
            del sys.modules[name]
        self.modules = frozenset(sys.modules)  # what stays is checked once, not after every test
        if _default_group() is not self.group:
            return "the test destroyed or replaced the default process group"
        if _group_count() != self.groups:
            return "the test created process groups (new_group)"
        for reset in self.resets:
            left = reset()
            if left is not None:
                return left
        running = [thread.name for thread in threading.enumerate() if thread not in self.threads]
        if running:
            return f"the test left threads running: {', '.join(sorted(running))}"
        return None

    def _forget(self, name: str, added: set[str]) -> bool:
        """Whether module ``name``, imported during the test, goes: the user's code, in a package added with it.

        A new submodule of a package loaded before the test stays (the package holds it as an attribute; a
        second copy would break identity), and so does anything installed or from the standard library.
        """
        if name.partition(".")[0] not in added or name.startswith("torchmetrics_gradpatch"):
            return False
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            return False
        return not str(Path(file).resolve()).startswith(self.roots)


def worker_main(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    conn: multiprocessing.connection.Connection,
    dump: _rank.DumpFile,
    parent: int,
) -> None:
    """Body of a pool worker: join the group as ``rank``, say :data:`READY`, then run each test sent to it.

    A test arrives as ``(context, pickled (fn, args))``: the context (environment, directory, ``sys.path``) is
    applied before ``fn`` is unpickled, so ``fn`` may live in a module only that path can import. The reply is
    ``("ok", (value, leftover))`` with ``leftover`` what the test left that needs new processes (or ``None``),
    or a failure as spawn_ranks' ranks send it. The pipe's end (the pool closing) ends the worker.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the pytest process's to handle
    out = _rank.enter(dump, parent)
    try:
        _rank.join_group(rank, world_size, port, timeout)
        baseline = _Baseline.capture()
    except BaseException as error:
        _rank.send(conn, _rank.failure(error))
        return
    _rank.send(conn, ("ok", (READY, None)))
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # no destroy_process_group: the group dies with the process, and cannot hang it
        _rank.clear_dump(out)  # a hang's stack dump shows this test only
        try:
            context, inner = pickle.loads(blob)
            baseline.apply(*context)
            fn, args = pickle.loads(inner)
            value = fn(*args)
            message: tuple[str, Any] = ("ok", (value, baseline.after()))
        except BaseException as error:  # reported like spawn_ranks' ranks; the pool retires these workers
            message = _rank.failure(error)
        _rank.send(conn, message)
