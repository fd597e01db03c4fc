"""A pre-imported parent that forks the `mp` executor's workers.

A worker started as `python -m kiln.executor.multiproc_worker` spends 3-5 s importing
torch, kiln and transformers before it does anything, and a tp x pp grid pays that once
per rank, per engine. The zygote is one `python -m kiln.executor.zygote` that imports all
of that once and waits; each worker is a `fork()` of it, running in a fraction of a
second. A process's first `mp` engine still spawns its workers (their imports side by
side beat one zygote importing alone: `engine_starting`); the zygote serves the engines
after it: a test suite, a script that builds several, a server that restarts its engine.

Fork safety: the zygote only imports. It runs no torch op, so no OpenMP pool, no
distributed group and no thread exists when it forks; each child sets its own threads,
joins its own world and builds its own model, as a spawned worker does.

What a spawned worker inherited, a forked one is handed with each request: the engine's
environment and working directory, and its stdout and stderr as they are now (file
descriptors passed over the socket, so output still goes where the engine's goes after a
test harness redirects it). A zygote started in another working directory or environment
is retired, since its imports read those. Workers die with the zygote and the zygote
with the engine (PR_SET_PDEATHSIG), as spawned workers die with the engine. The zygote
reports each child's exit status, which the engine reads as it reads a spawned worker's
(`ForkedWorker` has the `Popen` methods the executor uses).
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from typing import Any, Callable

from kiln import envs

_HEADER = struct.Struct("!Q")
# What every worker imports before it can start: the worker's module (torch, the runner,
# the models), transformers' config classes (a model config's unpickling) and Dynamo
# (torch's meta-device init ops import it while the model is built: 2.5 s here); and what
# a compiled engine's workers import too (Inductor, to load or build their pieces).
PRELOAD = ("kiln.executor.multiproc_worker", "transformers.models.auto.configuration_auto",
           "torch._dynamo")
PRELOAD_COMPILED = ("torch._inductor.standalone_compile",)


def _send(sock: socket.socket, obj: Any, fds: tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj)
    socket.send_fds(sock, [_HEADER.pack(len(data))], list(fds))
    sock.sendall(data)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; EOFError when the peer left."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not head:
        raise EOFError
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            raise EOFError
        head += more
    (size,) = _HEADER.unpack(head)
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return pickle.loads(data), fds


class ForkedWorker:
    """A worker forked by the zygote, with what `subprocess.Popen` offers the executor:
    `pid`, `returncode` (negative: the signal that killed it), `poll`, `wait`, `kill`."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.pid = pid
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
        self.returncode = code
        return code

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone; the zygote reports its status


class Zygote:
    """The engine's side: start the zygote, ask it for workers, learn how they ended."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.key = _key()
        # The zygote dies with the thread that started it (PR_SET_PDEATHSIG follows the
        # thread), as a spawned worker dies with the thread that spawned it.
        self.thread = threading.current_thread()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.executor.zygote", str(theirs.fileno()), *preload],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._forked: list[int] = []
        self._exits: dict[int, int] = {}
        self._alive = True
        threading.Thread(target=self._read, name="kiln-zygote-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                (kind, *rest), _ = _recv(self._sock)
                with self._changed:
                    if kind == "forked":
                        self._forked.append(rest[0])
                    else:  # "exited"
                        self._exits[rest[0]] = rest[1]
                    self._changed.notify_all()
        except (EOFError, OSError):
            pass
        with self._changed:  # its children die with it (PR_SET_PDEATHSIG)
            self._alive = False
            self._changed.notify_all()
        try:
            self.proc.wait(10)  # reap it (it exits after its last child, or was killed)
        except subprocess.TimeoutExpired:
            pass

    @property
    def alive(self) -> bool:
        return self._alive and self.proc.poll() is None

    def spawn(self, args: Any) -> ForkedWorker:
        """Fork a worker running `worker_main(args)`; raises OSError if the zygote is gone."""
        request = ("fork", args, dict(os.environ), os.getcwd())
        with self._lock:
            sys.stdout.flush()
            sys.stderr.flush()
            _send(self._sock, request, (1, 2))  # what a spawned worker would inherit
            bound = envs.KILN_DIST_STARTUP_TIMEOUT_S  # its imports come first, then this
            with self._changed:
                if not self._changed.wait_for(lambda: self._forked or not self._alive, bound):
                    self.proc.kill()  # so that no late fork runs a worker nobody awaits
                    raise OSError(f"the worker zygote did not answer in {bound:.0f} s")
                if not self._forked:
                    raise OSError("the worker zygote exited")
                return ForkedWorker(self, self._forked.pop(0))

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid, None if self._alive else -signal.SIGKILL)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self._alive, timeout)
        return self.exit_code(pid)

    def retire(self) -> None:
        """No more workers from this zygote: it exits once those it forked have (their
        ends are still reported)."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _key() -> tuple:
    """What the zygote's imports depend on (`-m` puts the working directory on its path):
    a change means a new zygote."""
    return sys.executable, os.getcwd(), tuple(sorted(os.environ.items()))


_current: list[Zygote] = []
_current_lock = threading.Lock()


def _usable(zygote: Zygote) -> bool:
    return zygote.alive and zygote.key == _key() and \
        zygote.thread is threading.current_thread()


_mp_engines = [0]  # `mp` engines started in this process with forking on


def engine_starting(compiled: bool) -> None:
    """Called as an `mp` engine starts. The first in a process spawns its ranks: their
    imports run side by side, which on free cores beats one zygote importing alone (a
    tiny tp=2 engine, 2 vCPUs: 7.0-8.0 s spawned, 8.6-10.6 s forked, three rounds each).
    From the second on, a zygote forks them, started here so its imports overlap this
    engine's own start-up; it imports Inductor too for a compiled engine (a later engine
    reuses it either way: a worker imports what its zygote did not). An engine with
    KILN_WORKER_FORK=0 keeps none and spawns, and is not counted."""
    with _current_lock:
        if _current and not (envs.KILN_WORKER_FORK and _usable(_current[0])):
            _current.pop().retire()
        if not envs.KILN_WORKER_FORK:
            return
        _mp_engines[0] += 1
        if _mp_engines[0] > 1 and not _current:
            _current.append(Zygote(PRELOAD + PRELOAD_COMPILED * compiled))


def spawn_worker(args: Any) -> ForkedWorker | None:
    """A worker forked from this process's zygote; None where there is none to use (the
    first engine, or the environment, directory or thread changed since it started)."""
    with _current_lock:
        zygote = _current[0] if _current and _usable(_current[0]) else None
    return None if zygote is None else zygote.spawn(args)


# --- the zygote process ----------------------------------------------------------------

def _child(args: Any, env: dict[str, str], cwd: str, fds: list[int],
           run: Callable[[Any], None], own: list[int]) -> None:
    """In the forked worker: the engine's environment, directory and output, then run."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    for fd in own:  # the zygote's wake-up pipe
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = 1
    try:
        run(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _serve(sock: socket.socket) -> None:
    """Fork on request and report each child's end. When the engine stops asking (EOF:
    it closed or retired this zygote), wait for the children still running, then exit."""
    import selectors

    from kiln.executor.multiproc_worker import _die_with_parent, worker_main

    _die_with_parent()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd is what counts
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: set[int] = set()
    asking = True
    while asking or children:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(sock, children)
                continue
            try:
                (_, args, env, cwd), fds = _recv(sock)
            except EOFError:
                sel.unregister(sock)
                asking = False
                continue
            pid = os.fork()
            if pid == 0:
                sel.close()
                sock.close()
                _child(args, env, cwd, fds, worker_main, [wake_r, wake_w])
            children.add(pid)
            for fd in fds:
                os.close(fd)
            _send(sock, ("forked", pid))


def main() -> None:
    import importlib

    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in sys.argv[2:]:
        importlib.import_module(name)
    _serve(sock)


if __name__ == "__main__":
    main()
