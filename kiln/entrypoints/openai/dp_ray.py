"""`kiln serve -dp N --data-parallel-backend ray`: each replica a child `kiln serve` started
by a Ray actor, anywhere on a Ray cluster (vLLM's `--data-parallel-backend ray`).

The cluster: `RAY_ADDRESS` (or the Ray this process joined already), else a local Ray on
127.0.0.1, started for this front and shut down with it (as kiln.executor.ray_executor
does). One placement group holds a bundle per replica, `{"CPU": tp x pp}` (or `{"GPU":
tp x pp}` on a cluster with GPUs), SPREAD: replicas on different nodes where possible.
The actor in each bundle starts an ordinary `kiln serve` child (its ranks are `mp`
processes on that node) on its node's address and a free port; the router reaches it
over the network and watches it through `RayProcess`, a Popen look-alike.

Death: dp_child ties the child to its actor (PR_SET_PDEATHSIG), so a replica dies with
its actor, whether killed or lost with its node; the front reads that as SIGKILL. On
every stop the actors are killed and the placement group removed, so nothing stays on
the cluster. Logs: a child's output goes to its actor's log on its node (Ray's
worker-*.out), not to the front; only its last lines come back, if it fails to start.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Any

from kiln.distributed.hosts import free_port, import_ray
from kiln.entrypoints.openai.dp_replicas import (_LOG_TAIL_LINES, RAY_BACKEND, Replica,
                                                 ReplicaSet, ReplicaStartError, child_argv)

logger = logging.getLogger(__name__)
_ENV_PREFIXES = ("KILN_", "TORCHINDUCTOR_")  # on a cluster, actors don't inherit ours
_KILLED = -int(signal.SIGKILL)  # a replica whose actor died: its child got SIGKILL too
PLACE_TIMEOUT_S = 60.0  # placement group and actors: more means the cluster is too small


class ReplicaActor:
    """Hosts one replica's child on its node (made a Ray actor class by `ray.remote` at
    run time: Ray is optional). Run threaded, since `wait` blocks for the child's life
    and `terminate` must still get through; Ray's actor threads live as long as the
    actor, so the thread that forks the child (what PDEATHSIG watches) does too."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)

    def start(self, argv: list[str], threads: str) -> tuple[str, str, int, int]:
        """(node id, node address, port, child pid) once the child is started."""
        import ray

        ip = ray.util.get_node_ip_address()
        port = free_port(ip)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.entrypoints.openai.dp_child", str(os.getpid()),
             "", *child_argv(argv, port, ip)],  # "": Ray owns CPU placement, no pinning
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS=threads), start_new_session=True)
        self._reader = threading.Thread(target=self._copy, args=(self._proc.stdout,),
                                        daemon=True)
        self._reader.start()
        return ray.get_runtime_context().get_node_id(), ip, port, self._proc.pid

    def _copy(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self._tail.append(line)
            print(line, flush=True)  # into this actor's log on its node

    def wait(self) -> tuple[int, list[str]]:
        """The child's exit status and last output lines, once it has exited."""
        assert self._proc is not None, "start first"
        code = self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return code, list(self._tail)

    def terminate(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()  # SIGTERM: the child shuts its engine down


class RayProcess:
    """The subprocess.Popen members the router and ReplicaSet use, for a child started by
    a ReplicaActor: it has exited once the actor's `wait` call has finished."""

    stdout: IO[bytes] | None = None  # not relayed: the output stays on the node

    def __init__(self, ray: Any, actor: Any, pid: int) -> None:
        self._ray, self._actor, self.pid = ray, actor, pid
        self._done = actor.wait.remote()
        self._killed = False
        self.returncode: int | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)

    def poll(self) -> int | None:
        # timeout=0 asks the owner's (our) record of the call: no round trip to the node
        if self.returncode is None and self._ray.wait([self._done], timeout=0)[0]:
            try:
                self.returncode, lines = self._ray.get(self._done)
                self.tail.extend(lines)
            except Exception as exc:  # noqa: BLE001 - the actor died, or its node did
                self.returncode = _KILLED
                if not self._killed:
                    logger.error("the Ray actor of replica pid %d died: %s", self.pid,
                                 str(exc).strip().splitlines()[0][:300])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ray.wait([self._done], timeout=timeout)[0]:
            raise subprocess.TimeoutExpired(f"replica pid {self.pid}", timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def terminate(self) -> None:
        self._actor.terminate.remote()  # no need to wait: `wait` tells when it exited

    def kill(self) -> None:
        self._killed = True
        with contextlib.suppress(Exception):  # gone already
            self._ray.kill(self._actor, no_restart=True)  # the child dies with it


class RayReplicaSet(ReplicaSet):
    """The N replicas on Ray; `stop_all` also releases the actors, the placement group
    and a Ray this front started."""

    def __init__(self, ray: Any, own_ray: bool) -> None:
        super().__init__([])
        self._ray, self._own_ray = ray, own_ray
        self._pg: Any = None
        self._actors: list[Any] = []

    @classmethod
    def start(cls, argv: list[str], n: int, ranks: int) -> RayReplicaSet:
        ray = import_ray(*RAY_BACKEND)
        own = not ray.is_initialized()
        if own:
            address = os.environ.get("RAY_ADDRESS")
            handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     **({} if address else {"_node_ip_address": "127.0.0.1"}))
            for s, h in handlers.items():  # ray.init took SIGTERM: the front's must stop
                signal.signal(s, h)            # the replicas in order (dp_serve.py)
        self = cls(ray, own)
        try:
            self._place(argv, n, ranks)
        except BaseException:  # a failed or interrupted start leaves nothing behind
            self.stop_all(grace_s=5.0)
            raise
        return self

    def _place(self, argv: list[str], n: int, ranks: int) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        # The children pick CUDA wherever torch sees it, so a cluster with GPUs gets GPU
        # bundles (one device per rank, never shared: see device_slices).
        gpu = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"GPU": ranks} if gpu else {"CPU": ranks}
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy="SPREAD")
        if not ray.wait([self._pg.ready()], timeout=PLACE_TIMEOUT_S)[0]:
            raise ReplicaStartError(f"the Ray cluster cannot place {n} replicas of "
                                    f"{bundle} (it has {ray.cluster_resources()}): add "
                                    "nodes or lower -dp, -tp or -pp")
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, bundle.get("CPU", 0)))
        actor_cls = ray.remote(ReplicaActor)
        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(self._pg,
                                                        placement_group_bundle_index=i)
            self._actors.append(actor_cls.options(
                num_cpus=0 if gpu else ranks, num_gpus=ranks if gpu else 0,
                max_concurrency=4, scheduling_strategy=strategy,
                runtime_env={"env_vars": env}).remote())
        try:
            started = ray.get([a.start.remote(argv, threads) for a in self._actors],
                              timeout=PLACE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - Ray's reason, for the message
            raise ReplicaStartError("a replica's Ray actor did not start: "
                                    + str(exc).strip().splitlines()[0][:300]) from None
        for i, (actor, (node, ip, port, pid)) in enumerate(zip(self._actors, started)):
            proc = RayProcess(ray, actor, pid)
            self.replicas.append(Replica(i, port, proc, host=ip, log_tail=proc.tail))
            logger.info("data parallel: replica %d (pid %d) on %s:%d, Ray node %s, %s, "
                        "OMP_NUM_THREADS=%s", i, pid, ip, port, node[:12], bundle, threads)

    def stop_all(self, grace_s: float = 30.0) -> None:
        ray = self._ray
        try:
            super().stop_all(grace_s)  # SIGTERM through each actor, ray.kill after grace
        finally:
            for actor in self._actors:  # each outlives its child: release its bundle
                with contextlib.suppress(Exception):  # gone already
                    ray.kill(actor, no_restart=True)
            if self._pg is not None:
                with contextlib.suppress(Exception):  # the cluster went away meanwhile
                    ray.util.remove_placement_group(self._pg)
            if self._own_ray and ray.is_initialized():
                ray.shutdown()  # a local Ray stops; a joined cluster is only left
