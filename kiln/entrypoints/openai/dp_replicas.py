"""The engine replicas of `kiln serve -dp N`: N child `kiln serve` processes on 127.0.0.1
(`--data-parallel-backend ray`, children on a Ray cluster's nodes: dp_ray.py).

Each child is an ordinary `kiln serve` (same arguments, minus the data-parallel flags, on
127.0.0.1 and a free port), so a replica is exactly what one server is: its own engine,
scheduler, KV cache and compile-cache entry. The front (`dp_router.py`) only routes HTTP.

Promises: a child gets an even share of the host (a CPU slice, or tp x pp CUDA devices);
every child dies with the front (PR_SET_PDEATHSIG in dp_child.py, plus `stop_all` on
every way out); `alive` turns False once and stays False (a replica is never restarted).
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Protocol

from kiln.distributed.hosts import free_port, import_ray

logger = logging.getLogger(__name__)
DP_BACKENDS = ("mp", "ray")  # vLLM's --data-parallel-backend names
# For the message when Ray is missing: what asked for it, and what needs none.
RAY_BACKEND = ("data_parallel_backend='ray'",
               "--data-parallel-backend mp (the default: the replicas as processes on "
               "this host)")
_DP_FLAGS = ("-dp", "--data-parallel-size", "--data-parallel-backend")
_LOG_TAIL_LINES = 40  # a failed start-up shows this much of the child's output


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1, metavar="N",
                   help="serve N engine replicas (processes) behind this one endpoint; "
                        "each request goes to the replica with the fewest in flight")
    p.add_argument("--data-parallel-backend", default="mp", choices=DP_BACKENDS,
                   help="who starts the replicas: mp (child processes on this host; "
                        "default) or ray (Ray actors place them over a Ray cluster: "
                        "RAY_ADDRESS, else a local Ray)")


def check_data_parallel(args: argparse.Namespace) -> int:
    """The replica count, or a ValueError naming the field and the fix. Runs before
    anything starts, so a bad combination costs no model load."""
    n = args.data_parallel_size
    if n < 1:
        raise ValueError(f"data_parallel_size={n} must be at least 1 (-dp 1: one engine, "
                         "no router)")
    if n == 1:
        return n
    if args.data_parallel_backend == "ray":
        import_ray(*RAY_BACKEND)  # missing: refused before anything starts
    if args.pd_proxy is not None:
        raise ValueError(f"--pd-proxy runs no engine, so data_parallel_size={n} has "
                         "nothing to replicate: drop -dp, or give -dp to the prefill and "
                         "decode servers instead")
    if args.distributed_executor_backend == "external_launcher":
        raise ValueError("distributed_executor_backend='external_launcher' cannot serve "
                         f"with data_parallel_size={n}: torchrun starts the ranks, not the "
                         "router; use 'mp' (the default with -tp N)")
    if _kv_connector(args.kv_transfer_config) == "torch_distributed":
        # Every replica would host or join the same P/D rendezvous (kv_ip:kv_port).
        raise ValueError(f"data_parallel_size={n} with kv_connector 'torch_distributed': "
                         "the replicas would share one P/D rendezvous; run one prefill "
                         "and one decode server without -dp (the disk tier may be shared)")
    return n


def _kv_connector(config: str | None) -> str | None:
    try:  # bad JSON is the children's to report, with their own message
        value = json.loads(config) if config else None
    except json.JSONDecodeError:
        return None
    return value.get("kv_connector") if isinstance(value, dict) else None


def child_argv(argv: list[str], port: int, host: str = "127.0.0.1") -> list[str]:
    """`kiln serve` arguments for one replica: the front's own, without the data-parallel
    flags, on `host`:`port` (a Ray replica listens on its node's address). The later
    --host/--port win over the user's (argparse keeps the last), and the trailing
    `--data-parallel-size 1` also covers an abbreviation the stripping missed
    (`--data-parallel-s 2`): a child can never start children."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _DP_FLAGS:
            skip = True  # the flag and its value
        elif not (a.startswith(tuple(f + "=" for f in _DP_FLAGS))
                  or (a.startswith("-dp") and a[3:].isdigit())):
            out.append(a)
    return [*out, "--host", host, "--port", str(port), "--data-parallel-size", "1"]


def cpu_slices(n: int) -> list[list[int]] | None:
    """This process's CPUs (its affinity mask) cut into `n` equal runs, the remainder
    unused; None when there are fewer CPUs than replicas (they then share them)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    k = len(cpus) // n
    return [cpus[i * k:(i + 1) * k] for i in range(n)] if k else None


def device_slices(n: int, ranks: int) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each replica (`ranks` = tp x pp devices each), or None on
    a CPU host. Two engines on one GPU would each size their KV cache from the same free
    memory, so a replica never shares a device (vLLM refuses it too)."""
    from kiln.platforms import current_platform  # torch: only when replicas start

    if current_platform.device_type == "cpu":
        return None
    if current_platform.device_type != "cuda":
        raise ValueError(f"data_parallel_size={n} splits CPUs or CUDA devices; this "
                         f"platform is {current_platform.device_type!r}: run one server "
                         "per device instead")
    import torch

    var = current_platform.device_control_env_var
    visible = [v.strip() for v in os.environ.get(var, "").split(",") if v.strip()]
    visible = visible or [str(i) for i in range(torch.cuda.device_count())]
    if len(visible) < n * ranks:
        raise ValueError(f"data_parallel_size={n} x {ranks} ranks per replica (tp x pp) "
                         f"needs {n * ranks} CUDA devices, {len(visible)} are visible: "
                         "lower -dp")
    return [",".join(visible[i * ranks:(i + 1) * ranks]) for i in range(n)]


class ReplicaStartError(RuntimeError):
    """A replica exited, or was not healthy in time, during start-up."""


class ReplicaProcess(Protocol):
    """What the router and ReplicaSet use of a replica's process: a subprocess.Popen, or
    dp_ray.RayProcess for a child on a Ray node."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


@dataclass(slots=True)
class Replica:
    """One child server and the router's own counts for it (the event loop's only)."""

    index: int
    port: int
    proc: ReplicaProcess
    host: str = "127.0.0.1"  # the address it listens on (a Ray replica: its node's)
    alive: bool = True
    in_flight: int = 0  # HTTP requests sent and not yet answered in full
    requests_total: int = 0
    errors_total: int = 0  # requests that failed because the replica did
    exit_reason: str | None = None
    log_tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_LOG_TAIL_LINES))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return f"http://{host}:{self.port}"

    def describe_exit(self) -> str | None:
        """How the process ended ('exited with 1', 'killed by SIGKILL'); None if running."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with {code}"


class ReplicaSet:
    """The N children: start, wait until each answers /health, stop."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas

    @classmethod
    def start(cls, argv: list[str], n: int, ranks: int) -> ReplicaSet:
        """`ranks`: the processes of one replica's engine (tp x pp), a device each."""
        devices = device_slices(n, ranks)
        cpus = None if devices is not None else cpu_slices(n)
        threads = max(1, len(os.sched_getaffinity(0)) // n) \
            if hasattr(os, "sched_getaffinity") else 1
        parent = os.getpid()
        replicas = []
        for i in range(n):
            port = free_port()
            env = dict(os.environ)
            # The user's OMP_NUM_THREADS wins; else each replica runs on its share only
            # (N replicas of all cores would time-slice every OpenMP barrier).
            env.setdefault("OMP_NUM_THREADS", str(threads))
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices[i]
            mine = cpus[i] if cpus else None
            # dp_child ties the child's life to ours, pins it, then runs `kiln serve`.
            # A new session: Ctrl-C at a terminal reaches the front only, which stops
            # the children in order (a child dying first would look like a failure).
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.entrypoints.openai.dp_child", str(parent),
                 ",".join(map(str, mine or ())), *child_argv(argv, port)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)
            replicas.append(r := Replica(i, port, proc))
            if proc.stdout is not None:
                threading.Thread(target=_relay, args=(r, proc.stdout), daemon=True,
                                 name=f"dp{i}-log").start()
            logger.info("data parallel: replica %d (pid %d) on 127.0.0.1:%d, %s", i,
                        proc.pid, port, f"CUDA devices {devices[i]}" if devices else
                        f"CPUs {mine or 'shared'}, OMP_NUM_THREADS="
                        f"{env['OMP_NUM_THREADS']}")
        return cls(replicas)

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.25) -> None:
        """Return once every child answers /health with 200; a child that exits first,
        or a start-up past `timeout_s`, is a ReplicaStartError with that child's output."""
        import httpx

        waiting = set(range(len(self.replicas)))
        deadline = time.monotonic() + timeout_s
        while waiting:
            for i in sorted(waiting):
                r = self.replicas[i]
                if (how := r.describe_exit()) is not None:
                    raise ReplicaStartError(f"replica {i} (pid {r.proc.pid}) {how} during "
                                       f"start-up:\n" + "\n".join(r.log_tail))
                try:
                    if httpx.get(f"{r.url}/health", timeout=2).status_code == 200:
                        waiting.discard(i)
                except httpx.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise ReplicaStartError(f"replicas {sorted(waiting)} not ready after "
                                   f"{timeout_s:.0f} s")
            if waiting:
                time.sleep(poll_s)

    def stop_all(self, grace_s: float = 30.0) -> None:
        """SIGTERM every child at once (each shuts its engine down), SIGKILL those still
        running after `grace_s`; returns once all are reaped."""
        for r in self.replicas:
            if r.proc.poll() is None:
                r.proc.terminate()
        deadline = time.monotonic() + grace_s
        for r in self.replicas:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("replica %d (pid %d) ignored SIGTERM for %.0f s: killing it",
                               r.index, r.proc.pid, grace_s)
                r.proc.kill()
                r.proc.wait()
            r.alive = False


def _relay(replica: Replica, stream: IO[bytes]) -> None:
    """Copy a child's output to ours, each line tagged with its replica (as vLLM tags
    its DP engines), keeping the last lines for a start-up error."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        replica.log_tail.append(line)
        try:
            print(f"(dp{replica.index}) {line}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # our stderr is closed: keep draining the pipe
            pass
    stream.close()
