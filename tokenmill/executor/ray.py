"""Workers as Ray actors, one per rank, placed by a placement group: how a deployment spans machines.

The engine joins a running Ray cluster (`ray start --head` on one node, `ray start --address=...` on the
others) or, when none runs, starts a local Ray instance. Ranks are ordered by node (the engine's node first)
so a tensor-parallel group stays on one node when it fits there; torch.distributed rendezvous at the first
rank's node IP. A step's SchedulerOutput is encoded and `ray.put` once, and the one reference is passed to
every actor; the output rank's result is read back. Each node resolves the model from the user's argument
itself (worker.init_worker_process), so the same path must exist on every node, as for the model files
themselves; a GGUF file is converted into each node's own cache.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from tokenmill import step
from tokenmill.config import EngineConfig
from tokenmill.executor.base import COLLECTIVE_FAILED, Executor, Method, WorkerDiedError, collective_failed, run_method

logger = logging.getLogger("tokenmill")

PLACEMENT_TIMEOUT_S = 120.0
HEALTH_INTERVAL_S = 2.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'") from None
    return ray


class _RayWorker:
    """The actor: a Worker of one rank, built by start() once the world's address is known."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = None
        self.rank = -1
        pc = config.parallel
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def node(self) -> tuple[str, str, list[str]]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), \
            [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        from tokenmill.executor.multiproc import free_port  # zmq: only rank 0's actor, not the engine process

        return free_port()

    def start(self, rank: int, init_method: str, log_level: int, num_threads: int, visible_devices: Optional[str],
              local_rank: int) -> None:
        if visible_devices is not None:  # all of this node's ranks' GPUs, so NCCL can use peer-to-peer copies
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        # The model stack imports torch: in the actor's process only, after CUDA_VISIBLE_DEVICES above
        from tokenmill.worker.worker import Worker, init_worker_process

        logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s[rank {rank}]: %(message)s")
        self.rank = rank
        init_worker_process(self.config, rank, init_method, local_rank, num_threads)
        self.worker = Worker(self.config, rank=rank)

    def execute_model(self, data: bytes) -> Optional[bytes]:
        try:
            out = self.worker.execute_model(step.decode_scheduler_output(data))
        except Exception as e:
            if collective_failed(e, self.config.parallel.world_size):
                logging.getLogger("tokenmill").error("a collective failed; this rank exits: %s", e)
                os._exit(COLLECTIVE_FAILED)
            raise
        return step.encode(out) if self.rank == self.output_rank else None

    def rpc(self, method: Method, args: tuple, kwargs: dict) -> Any:
        return run_method(self.worker, method, args, kwargs)

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _portable(config: EngineConfig) -> EngineConfig:
    """The config the actors get: model arguments as absolute paths (an actor runs in Ray's own directory)."""
    config = copy.deepcopy(config)
    for part in (config.model, config.speculative):
        if part is not None and part.model and os.path.exists(part.model):
            part.model = os.path.abspath(part.model)
    return config


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.ray = import_ray()
        self.failure: Optional[WorkerDiedError] = None
        self.actors: list = []
        self.placement = None
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-ray-steps")
        self._started_ray = self._connect()
        self._last_health = time.monotonic()
        try:
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    def _connect(self) -> bool:
        """Join a running cluster if there is one, else start a local Ray instance. Returns whether we
        started (and so must stop) Ray."""
        ray = self.ray
        if ray.is_initialized():
            logger.info("Ray: using this process's Ray connection")
            return False
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING)
            logger.info("Ray: joined the running cluster (%d CPUs, %d GPUs over %d node(s))", *self._cluster_size())
        except ConnectionError:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
            logger.info("Ray: no cluster running; started a local Ray instance (%d CPUs, %d GPUs)",
                        *self._cluster_size()[:2])
        return True

    def _cluster_size(self) -> tuple[int, int, int]:
        res = self.ray.cluster_resources()
        return int(res.get("CPU", 0)), int(res.get("GPU", 0)), len([n for n in self.ray.nodes() if n["Alive"]])

    def _bundle(self) -> dict:
        if self.config.device == "cuda":
            return {"GPU": 1}
        # CPU ranks split the cores as the mp executor does (over the cluster, which a node-local count can't)
        return {"CPU": max(1, int(self.ray.available_resources().get("CPU", 1)) // self.world_size)}

    def _start_actors(self) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        self.placement = placement_group([bundle] * self.world_size, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster cannot place {self.world_size} ranks of {bundle} within "
                               f"{PLACEMENT_TIMEOUT_S:.0f}s (available: {ray.available_resources()})") from None
        env = {k: v for k, v in os.environ.items() if k.startswith(("TOKENMILL_", "OMP_"))}
        cls, config = ray.remote(_RayWorker), _portable(self.config)
        actors = [cls.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                              runtime_env={"env_vars": env} if env else None,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i))
                  .remote(config) for i in range(self.world_size)]
        nodes = self._get([a.node.remote() for a in actors], "placement")
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(self.world_size), key=lambda i: (nodes[i][0] != here, nodes[i][0], i))
        self.actors = [actors[i] for i in order]  # rank -> actor: the engine's node first, a node's ranks adjacent
        nodes = [nodes[i] for i in order]
        port = self._get([self.actors[0].free_port.remote()], "start-up")[0]
        init_method = f"tcp://{nodes[0][1]}:{port}"
        t0 = time.monotonic()
        threads = int(bundle.get("CPU", 1))
        level = logging.getLogger("tokenmill").getEffectiveLevel()
        self._get([a.start.remote(r, init_method, level, threads, *self._devices(nodes, r))
                   for r, a in enumerate(self.actors)], "start-up")
        logger.info("%d Ray actors ready in %.1fs on %s (torch.distributed at %s)", self.world_size,
                    time.monotonic() - t0, ", ".join(sorted({n[1] for n in nodes})), init_method)

    def _devices(self, nodes: list, rank: int) -> tuple[Optional[str], int]:
        """(CUDA_VISIBLE_DEVICES for the rank: its node's ranks' GPUs, its device's index among them)."""
        if self.config.device != "cuda":
            return None, 0
        node_id, _, gpus = nodes[rank]
        visible = sorted({g for n in nodes if n[0] == node_id for g in n[2]}, key=int)
        return ",".join(visible), visible.index(gpus[0])

    def _get(self, refs: list, what: str) -> list:
        """ray.get, naming the rank whose actor failed or died."""
        ray = self.ray
        try:
            pending = refs
            while len(pending) > 1:  # a failed rank raises at once, while its peers may wait on it in a collective
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            rank = self._failed_rank(refs, ray.exceptions.RayActorError)
            self._fail(WorkerDiedError(f"worker rank {rank} (Ray actor) died during {what}: "
                                       f"{str(e).splitlines()[0]}; the engine cannot continue without it"))
            raise self.failure from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise RuntimeError(f"worker rank {self._failed_rank(refs, Exception)} failed during {what}: "
                               f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}") from None

    def _failed_rank(self, refs: list, kind: type) -> str:
        """The first rank whose ref holds an error of `kind` (a dead actor's, rather than a peer's error)."""
        for r, ref in enumerate(refs):
            ready, _ = self.ray.wait([ref], timeout=0)
            if ready:
                try:
                    self.ray.get(ready[0])
                except kind:
                    return str(r)
                except Exception:  # noqa: BLE001 - a consequence, not the cause
                    pass
        return "?"

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None) -> list:
        self.check_health(force=False)
        return self._get([a.rpc.remote(method, tuple(args), kwargs or {}) for a in self.actors], "rpc")

    def execute_model(self, scheduler_output, non_block: bool = False):
        if self.failure is not None:
            raise self.failure
        data = self.ray.put(step.encode(scheduler_output))  # serialized once; every actor gets the reference
        refs = [a.execute_model.remote(data) for a in self.actors]
        if not non_block:
            return self._step_result(refs)
        return self._waiter.submit(self._step_result, refs)  # one thread: results in submission order

    def _step_result(self, refs: list):
        return step.decode_runner_output(self._get(refs, "a step")[self.output_rank])

    def check_health(self, force: bool = True) -> None:
        """While idle, ping every actor at most every HEALTH_INTERVAL_S (a dead actor fails its ping)."""
        if self.failure is not None:
            raise self.failure
        if force and time.monotonic() - self._last_health >= HEALTH_INTERVAL_S:
            self._last_health = time.monotonic()
            self._get([a.ping.remote() for a in self.actors], "a health check")

    def _fail(self, failure: WorkerDiedError) -> None:
        self.failure = failure
        logger.error("%s", failure)
        for a in self.actors:  # the others would wait in a collective for the dead one
            self.ray.kill(a)

    def shutdown(self) -> None:
        ray = self.ray
        self._waiter.shutdown(wait=False, cancel_futures=True)
        if not ray.is_initialized():
            return
        if self.failure is None and self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
            self.placement = None
        if self._started_ray:
            ray.shutdown()
