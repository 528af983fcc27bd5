"""User runs of the verdict without paying each process's imports: one process imports what a user run imports,
then forks a child per run. Each child is a fresh pytest session (its own working directory, arguments, stdout and
stderr, its own exit code) as a user's process is after its imports.

A verdict run on a tiny draft is about 25 s of which 20 are imports (torch, transformers, sglang, the trainers,
matplotlib); the meta tests that check the verdict on every planted draft and then run the commands it printed
would spend most of `make test` importing. What starts a user's process (the interpreter, pytest's entry-point
plugin loaded from outside the repository, the `eagle3-conformance` script, make) is still run as a real process
by the tests that are about it: meta/test_verdict.py's cases with another `how`, meta/test_printed_commands.py,
meta/test_readme_commands.py. meta/test_preloaded.py checks that a preloaded run prints what a real process prints.

What is preloaded: the modules the previous children imported that pytest did not rewrite. Modules pytest rewrites
(this suite's, the plugins' of every pytest11 distribution) and test modules are left to each child, so that its
assertions and plugins are loaded exactly as in a user's process. The parent never runs a model and starts no
thread, so a fork is safe; gc.freeze() after the imports keeps each child's collections (the user store frees
every model with one) from walking the imported modules' objects.

Protocol: one JSON request per line on stdin ({"id", "argv", "cwd", "env", "stdout", "stderr"}), one JSON reply per
finished child on stdout ({"id", "code"}).
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import select
import shlex
import subprocess
import sys
import threading
from concurrent.futures import Future
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN = ("conformance", "fixtures", "reference", "conftest", "__main__", "__mp_main__")
# What a printed command may start (conformance/user/commands.py): the entry point's script, or this interpreter
# with one of these modules; each is run as its own `main` would be run.
ENTRY = "eagle3-conformance"
MODULES = ("pytest", "conformance.cli", "conformance.user.convert")


def importable(name: str, module) -> bool:
    """A module a child imported that the parent may import for the next children."""
    if name.split(".")[0] in OWN + tuple(rewritten()) or ".test_" in name or name.startswith("test_"):
        return False
    loader = getattr(module, "__loader__", None)
    return type(loader).__name__ != "AssertionRewritingHook"


@cache
def rewritten() -> frozenset[str]:
    """The top-level names pytest rewrites in a user's run: every pytest11 distribution's modules (pytest's own
    rule, _pytest/config/__init__.py _iter_rewritable_modules): this suite's, hypothesis', xdist's, ..."""
    from importlib.metadata import distributions

    from _pytest.config import _iter_rewritable_modules

    return frozenset(name for dist in distributions() if any(ep.group == "pytest11" for ep in dist.entry_points)
                     for name in _iter_rewritable_modules([str(f) for f in dist.files or ()]))


def _forget_own() -> None:
    """This suite's modules out of the parent (`-m conformance.meta.preloaded` imported its packages): each child
    imports them as a user's process does, its plugin's assertions rewritten. Third-party pytest11 packages a
    preloaded module imports (anyio under sglang's server, hypothesis) stay: pytest warns it cannot rewrite them,
    which only their own asserts' messages would show, and which the verdict's terminal does not print."""
    for name in [n for n in sys.modules if n.split(".")[0] in OWN and n != "__main__"]:
        del sys.modules[name]


def _child(request: dict) -> None:
    """In the forked child: the run, then os._exit with its code (never back into the parent's loop)."""
    code = 70
    try:
        for stream, path in ((1, request["stdout"]), (2, request["stderr"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, stream)
            os.close(fd)
        sys.stdin = open(os.devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # the request's PYTHONPATH, as a new interpreter would put it on the path (the parent's is ROOT)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra
        code = _run(request["argv"])
        # the modules this run imported, for the parent to preload before the next fork
        names = [n for n, m in list(sys.modules.items()) if m is not None and importable(n, m)]
        Path(request["stdout"] + ".modules").write_text("\n".join(names))
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:   # noqa: BLE001 - the child must end here whatever happened
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))


def _run(argv: list[str]) -> int:
    """argv as the shell would start it: `python -m MODULE ...` or the entry point's script."""
    import runpy

    program, *rest = argv
    if Path(program).name == ENTRY:
        if not Path(program).is_file():
            print(f"{program}: No such file or directory", file=sys.stderr)
            return 127
        from conformance.cli import main

        sys.argv = [program, *rest]
        return int(main(rest))
    if rest[:1] != ["-m"] or rest[1] not in MODULES or not Path(program).is_file():
        print(f"not a command this suite prints: {shlex.join(argv)}", file=sys.stderr)
        return 127
    module, args = rest[1], rest[2:]
    sys.argv = [module, *args]
    if module == "pytest":
        import pytest

        return int(pytest.main(args))
    sys.path.insert(0, os.getcwd())   # `python -m` puts the working directory first
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def serve(preload: list[str]) -> None:
    """The parent: preload, then fork a child per request, reply as each ends; single-threaded (a fork from a
    process with threads could copy a held lock). `preload`: modules to import first, kept even if they are this
    suite's (a meta test's plant)."""
    import torch  # noqa: F401 - the common base of every run, imported before the first fork

    rewritten()
    _forget_own()
    for name in preload:
        importlib.import_module(name)
    gc.freeze()
    children: dict[int, tuple[str, str]] = {}   # pid -> (request id, stdout path)
    preloaded: set[str] = set()
    # Requests are read from the file descriptor itself: select() sees only what the descriptor still holds, so
    # lines a buffered reader had already taken in (two requests written at once) would wait for the next
    # request, and the last of them forever.
    stdin, pending, open_input = sys.stdin.fileno(), b"", True
    while open_input or children:
        ready, _, _ = select.select([stdin] if open_input else [], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 1 << 16)
            open_input = bool(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = (request["id"], request["stdout"])
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rid, out = children.pop(pid)
            print(json.dumps({"id": rid, "code": os.waitstatus_to_exitcode(status)}), flush=True)
            _preload(Path(out + ".modules"), preloaded)


def _preload(listing: Path, preloaded: set[str]) -> None:
    if not listing.is_file():
        return
    for name in listing.read_text().split():
        if name in preloaded or name in sys.modules:
            continue
        preloaded.add(name)
        try:
            importlib.import_module(name)
        except Exception:   # noqa: BLE001 - a module only its importer can import (a lazy submodule's order)
            pass
    _forget_own()   # what a preloaded module imported of this suite's (none should)
    if threading.active_count() > 1:
        raise RuntimeError(f"a preloaded module started a thread: {threading.enumerate()}")
    gc.freeze()


class Preloaded:
    """The client: `run(argv, cwd, env)` returns a CompletedProcess as subprocess.run(capture_output=True,
    text=True) would; callable from several threads."""

    def __init__(self, scratch: Path, preload: tuple[str, ...] = ()):
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        # the parent's own output (what its preloading logs) goes to a file: the children's is in theirs
        self.log = open(self.scratch / "parent.log", "w")
        self.process = subprocess.Popen([sys.executable, "-m", "conformance.meta.preloaded", *preload], cwd=ROOT,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True)
        self.pending: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.count = 0
        self.reader = threading.Thread(target=self._replies, daemon=True)
        self.reader.start()

    def _replies(self) -> None:
        for line in self.process.stdout:
            reply = json.loads(line)
            with self.lock:
                future = self.pending.pop(reply["id"])
            future.set_result(reply["code"])
        with self.lock:   # the parent ended: every run still waiting fails
            for future in self.pending.values():
                future.set_exception(RuntimeError("the preloaded process ended"))
            self.pending.clear()

    def run(self, argv: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
        with self.lock:
            self.count += 1
            rid = str(self.count)
            future = self.pending[rid] = Future()
        out, err = self.scratch / f"{rid}.out", self.scratch / f"{rid}.err"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        request = {"id": rid, "argv": [str(a) for a in argv], "cwd": str(cwd), "env": env,
                   "stdout": str(out), "stderr": str(err)}
        with self.lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        code = future.result(timeout=timeout)
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=600)
        self.log.close()


if __name__ == "__main__":
    serve(sys.argv[1:])
