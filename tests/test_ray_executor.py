"""The `ray` executor: pp=2 over a local Ray cluster of two one-CPU nodes places one stage
per node and matches transformers; removing a node mid-generation fails the engine at
once with an error naming the rank and the node, and leaves no actor behind; with no
cluster, kiln starts a local one (tp=2 here) and shuts it down with the engine.

Everything stays on 127.0.0.1: Ray otherwise advertises this host's interface address,
so RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read when Ray is imported) keeps its nodes on the
loopback. Cost: about 20 s (two cluster starts, two engines at -O0)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from conftest import TINY, hf_greedy  # noqa: E402

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.executor.driver import WorkerDiedError  # noqa: E402

ray = pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).parent))
from tp_worker import PROMPTS  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> tuple[Path, transformers.PreTrainedModel]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**dict(TINY, num_hidden_layers=3), tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path_factory.mktemp("ray") / "llama3l"
    model.save_pretrained(path)
    return path, model


def _actors_left() -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return sum("RankActor" in line for line in out.stdout.splitlines())


def _wait_no_actors(seconds: float = 20) -> int:
    deadline = time.monotonic() + seconds
    while _actors_left() and time.monotonic() < deadline:
        time.sleep(0.2)
    return _actors_left()


def _engine(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", optimization_level=0, progress=False,
               num_kv_blocks=64, max_model_len=128, distributed_executor_backend="ray",
               **kwargs)


def test_pp2_on_a_two_node_ray_cluster_and_a_node_lost_mid_generation(llama3):
    from ray.cluster_utils import Cluster

    path, hf = llama3
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        llm = _engine(path, pipeline_parallel_size=2)
        nodes = llm.engine.executor.nodes
        assert len({node_id for node_id, _ in nodes}) == 2  # one stage per node
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12)
                                                          for p in PROMPTS]
        engine = llm.engine
        engine.add_request("long", {"prompt_token_ids": [1, 2, 3]},
                           SamplingParams(max_tokens=100, ignore_eos=True))
        for _ in range(3):
            engine.step()
        lost = [rank for rank, (node_id, _) in enumerate(nodes) if node_id == node.node_id]
        cluster.remove_node(node)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"worker rank {lost[0]} on node "):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30
        llm.shutdown()
        assert _wait_no_actors() == 0
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_without_a_cluster_kiln_starts_a_local_ray_and_stops_it(llama3):
    path, hf = llama3
    assert not ray.is_initialized()
    llm = _engine(path, tensor_parallel_size=2)
    try:
        assert ray.is_initialized()
        out = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[1], 12)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()
    assert _wait_no_actors() == 0
