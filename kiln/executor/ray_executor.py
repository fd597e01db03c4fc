"""`ray`: every rank a Ray actor, placed over a Ray cluster (vLLM's
`distributed_executor_backend="ray"`).

One placement group holds one bundle per rank (`{"CPU": 1}` on a CPU, `{"GPU": 1}` on
CUDA), packed (ranks fill a node before the next, so a TP group stays on one node where
it fits, and pipeline stages cross nodes). Each actor runs the same worker loop as an
`mp` process (kiln.executor.multiproc_worker) and joins the same torch.distributed world,
whose rendezvous is the engine's node address; everything said over it is
kiln.executor.driver's, so the two executors differ only in how ranks start, die and
stop.

The cluster: `RAY_ADDRESS` (or one this process joined already), else a local one is
started for this engine and shut down with it. Actors get kiln's environment variables
(KILN_*, TORCHINDUCTOR_*, VLLM_PP_LAYER_PARTITION) through their runtime environment:
on an existing cluster they do not inherit the engine's.

Death: the watchdog asks Ray which actor's loop ended; the error names the rank, its
node's address and id, and Ray's reason (a node removed, an actor killed). Every actor is
killed and the placement group removed on any stop, so nothing stays on the cluster.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
from typing import Any

import torch

from kiln.distributed.hosts import import_ray
from kiln.distributed.parallel_state import startup_timeout_s
from kiln.executor.driver import RankDriver, WorkerDiedError, describe_grid
from kiln.executor.multiproc_worker import WorkerArgs, worker_main
from kiln.executor.worker import RunnerSpec

logger = logging.getLogger(__name__)
__all__ = ["RayExecutor", "WorkerDiedError"]
_ENV_PREFIXES = ("KILN_", "TORCHINDUCTOR_", "TRITON_", "VLLM_PP_LAYER_PARTITION")


class RankActor:
    """One rank (made a Ray actor class by `ray.remote` at start-up: Ray is optional)."""

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def run(self, args: WorkerArgs) -> None:
        try:  # the engine's to handle; only possible where the actor runs on the main thread
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:
            pass
        worker_main(args)  # serves until shutdown, then leaves the process


class RayExecutor(RankDriver):
    def __init__(self, spec: RunnerSpec, tp: int, pp: int = 1) -> None:
        ray = self._ray = import_ray("distributed_executor_backend='ray'", "'mp'")
        self._own_cluster = not ray.is_initialized()
        if self._own_cluster:
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address or None, include_dashboard=False,
                     log_to_driver=logging.getLogger().isEnabledFor(logging.INFO),
                     **({} if address else {"_node_ip_address": "127.0.0.1"}))
        n, cuda = tp * pp, torch.device(spec.device).type == "cuda"
        self._bundle = {"GPU": 1} if cuda else {"CPU": 1}
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self.nodes: list[tuple[str, str]] = []  # each rank's (node id, node address)
        self._pg = self._placement_group(n)
        logger.warning("%s on Ray: %d actors, one %s bundle each", describe_grid(tp, pp), n,
                       self._bundle)
        super().__init__(spec, tp, pp, ray.util.get_node_ip_address(), threads=1)

    def _placement_group(self, n: int) -> Any:
        from ray.util.placement_group import placement_group

        pg = placement_group([dict(self._bundle)] * n, strategy="PACK")
        ready, _ = self._ray.wait([pg.ready()], timeout=min(60.0, startup_timeout_s()))
        if not ready:
            total = self._ray.cluster_resources()
            self._ray.util.remove_placement_group(pg)
            self._release_cluster()
            raise ValueError(f"the Ray cluster cannot place {n} ranks of {self._bundle} "
                             f"(it has {total}); add nodes or lower -tp/-pp")
        return pg

    # ---- the ranks -----------------------------------------------------------------------
    def _start_ranks(self, args: list[WorkerArgs]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        cuda = "GPU" in self._bundle
        actor_cls = self._ray.remote(RankActor)
        for a in args:
            strategy = PlacementGroupSchedulingStrategy(self._pg,
                                                        placement_group_bundle_index=a.rank)
            self._actors.append(actor_cls.options(
                num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0,
                scheduling_strategy=strategy, runtime_env={"env_vars": env}).remote())
        self.nodes = self._ray.get([actor.node.remote() for actor in self._actors])
        for a, (node, ip) in zip(args, self.nodes):
            logger.info("rank %d on node %s (%s)", a.rank, ip, node[:12])
        index = 0 if cuda else None  # a CUDA actor sees its own GPU only
        self._runs = [actor.run.remote(dataclasses.replace(a, device_index=index))
                      for actor, a in zip(self._actors, args)]

    def _find_dead(self) -> str | None:
        done, _ = self._ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        if not done:
            return None
        rank = self._runs.index(done[0])
        try:
            self._ray.get(done[0])
            why = "left its loop"
        except Exception as exc:  # noqa: BLE001 - Ray's reason, for the report
            why = str(exc).strip().splitlines()[0][:300]
        node, ip = self.nodes[rank]
        return f"worker rank {rank} on node {ip} ({node[:12]}) died: {why}"

    def _kill_all(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def _wait_all(self, seconds: float) -> None:
        if self._runs:
            self._ray.wait(self._runs, num_returns=len(self._runs), timeout=seconds)

    def _released(self) -> None:
        try:
            self._ray.util.remove_placement_group(self._pg)
        except Exception:  # noqa: BLE001 - the cluster went away meanwhile
            pass
        self._release_cluster()

    def _release_cluster(self) -> None:
        if self._own_cluster and self._ray.is_initialized():
            self._ray.shutdown()

