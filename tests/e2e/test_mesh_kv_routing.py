"""Several engine replicas act as one (issue 15), on the real mesh: two SmolLM2
engines with small KV caches publish KV events to the cache service, whose
prefix index (in a real Redis started here) the routers use.

* the index names the replica that served a prompt, with the right block
  count; eviction lowers it; a killed replica leaves the index within 2 s;
* ``kv_aware`` routing gets at least 3x the prefix-hit tokens of
  ``round_robin`` on shared system prompts, with identical greedy answers;
* with Redis killed mid-run, requests see no errors, and hits come back on
  their own once Redis is back.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from llmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.cli.mesh import Mesh, log_tail
from services.common.block_hash import prompt_block_hashes
from tests.cache.redis_server import RedisProcess, start_redis_server

pytestmark = pytest.mark.mesh

#: 512 tokens of KV per replica (45 KiB per SmolLM2 token in fp32): two of
#: the ~200-token system prompts below fit, three do not. (Half the size of
#: docs/architecture.md's first measurement twice over: what the tests prove is
#: relative to the cache's capacity, and prefill is the module's cost.)
KV_BYTES = "22.5MiB"
BLOCK = 16


@pytest.fixture(scope="module")
def kv_redis() -> Iterator[RedisProcess]:
    server = start_redis_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def kv_mesh(tmp_path_factory: pytest.TempPathFactory, kv_redis: RedisProcess) -> Iterator[Mesh]:
    """Two engines (one CPU each) with small KV caches, the cache on Redis,
    the default router (kv_aware with two engines)."""
    engine_args = ["--kv-cache-bytes", KV_BYTES, "--max-model-len", "512",
                   "--max-num-seqs", "8"]
    with Mesh(ingress_port=0, admin_port=0, run_dir=tmp_path_factory.mktemp("kvmesh"),
              redis_url=kv_redis.url, num_engines=2, engine_args=engine_args) as mesh:
        yield mesh


def system_prompt(topic: int, words: int = 200) -> str:
    """A deterministic ~200-token text about ``topic`` (one token per word)."""
    vocab = ["river", "mountain", "engine", "harbor", "violet", "copper", "lantern", "orchard",
             "glacier", "meadow", "compass", "falcon", "quartz", "ember", "willow", "canyon"]
    body = " ".join(vocab[(topic * 7 + i * (topic + 3)) % len(vocab)] for i in range(words))
    return f"Document {topic}. {body}.\n"


def ask(address: str, prompt: str, max_tokens: int = 4) -> tuple[str, int]:
    """Greedy generation through a router (or Envoy); returns (text, cached prompt tokens)."""
    request = generation_pb2.GenerateRequest(
        prompt=prompt, bypass_cache=True,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = list(stub.Generate(request, timeout=300))
    return "".join(r.text for r in responses), responses[-1].usage.cached_prompt_tokens


def prompt_hashes(mesh: Mesh, prompt: str) -> list[bytes]:
    """The prompt's block hashes as the engines compute them."""
    with grpc.insecure_channel(mesh.services["tokenizer"].grpc_address) as channel:
        ids = tokenizer_pb2_grpc.TokenizerServiceStub(channel).Tokenize(
            tokenizer_pb2.TokenizeRequest(text=prompt, add_special_tokens=True), timeout=30)
    with grpc.insecure_channel(mesh.engines[0].grpc_address) as channel:
        info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=30)
    assert info.kv_block_size == BLOCK and len(info.kv_hash_seed) == 32
    return prompt_block_hashes(info.kv_hash_seed, list(ids.token_ids), info.kv_block_size)


def score(mesh: Mesh, hashes: list[bytes]) -> dict[str, int]:
    with grpc.insecure_channel(mesh.services["cache"].grpc_address) as channel:
        reply = cache_pb2_grpc.CacheServiceStub(channel).ScorePrefix(
            cache_pb2.ScorePrefixRequest(block_hashes=hashes), timeout=5)
    return {s.replica_id: s.matched_blocks for s in reply.scores}


def wait_for(condition, timeout: float, poll: float = 0.05):  # noqa: ANN001, ANN201
    """Polls ``condition()`` until truthy; returns (value, seconds waited)."""
    started = time.monotonic()
    while True:
        value = condition()
        if value or time.monotonic() - started > timeout:
            return value, time.monotonic() - started
        time.sleep(poll)


def served(mesh: Mesh, prompt: str) -> tuple[list[bytes], str, int]:
    """Sends ``prompt``; returns its block hashes and the one replica the index
    names for it with its block count (within 2 s)."""
    hashes = prompt_hashes(mesh, prompt)
    ask(mesh.ingress_address, prompt)
    scores, _ = wait_for(lambda: score(mesh, hashes), timeout=2.0)
    assert len(scores) == 1, scores
    (replica, blocks), = scores.items()
    return hashes, replica, blocks


def engine_named(mesh: Mesh, replica: str) -> str:
    """The mesh's name (``engine-N``) of the engine publishing as ``replica``."""
    names = [e.name for e in mesh.engines
             if e.argv[e.argv.index("--replica-id") + 1] == replica]
    assert len(names) == 1, (replica, names)
    return names[0]


def metric_sum(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def run_workload(address: str, prompts: list[str]) -> list[tuple[str, int]]:
    """The prompts in order, two at a time (one per replica at best)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda p: ask(address, p), prompts))


def test_the_index_names_the_replica_that_served_a_prompt(kv_mesh: Mesh) -> None:
    prompt = system_prompt(101) + "Question: which word comes first?\nAnswer:"
    assert not score(kv_mesh, prompt_hashes(kv_mesh, prompt))
    hashes, replica, blocks = served(kv_mesh, prompt)
    assert engine_named(kv_mesh, replica) in ("engine-0", "engine-1")
    assert blocks == len(hashes)
    # The same prompt again goes to that replica and hits its whole prefix.
    _, cached = ask(kv_mesh.ingress_address, prompt)
    assert cached == len(hashes) * BLOCK


def test_eviction_lowers_the_count(kv_mesh: Mesh) -> None:
    hashes, replica, before = served(
        kv_mesh, system_prompt(202) + "Question: name a metal.\nAnswer:")
    # Other long prompts fill both replicas' small caches (LRU evicts ours).
    run_workload(kv_mesh.ingress_address, [system_prompt(300 + i) for i in range(8)])
    after, _ = wait_for(lambda: score(kv_mesh, hashes).get(replica, 0) < before, timeout=2.0)
    assert after, f"still {score(kv_mesh, hashes)} after filling the caches"


def engine_requests(mesh: Mesh) -> dict[str, float]:
    return {e.name: metric_sum(e.metrics_address, "llmesh:request_success_total")
            for e in mesh.engines}


def test_a_conversation_stays_on_its_replica(kv_mesh: Mesh) -> None:
    """Turns of one GenerateStream go to one replica even when they share no
    prefix (separate calls alternate between two idle replicas)."""
    turns = [f"Session turn {i}: name a colour." for i in range(4)]
    before = engine_requests(kv_mesh)
    for turn in turns:  # separate calls: ties rotate, a booked request tips the next
        ask(kv_mesh.ingress_address, turn, 2)
    middle = engine_requests(kv_mesh)
    # Both replicas take some of them: 2/2 when the two are priced alike, 1/3 when
    # their measured step profiles differ by more than the tie tolerance (the
    # earlier tests of this module measure them; it varies with the machine's load).
    assert sorted(middle[n] - before[n] for n in middle) in ([2, 2], [1, 3])

    def starts():  # noqa: ANN202
        for turn in turns:
            yield generation_pb2.GenerateStreamRequest(start=generation_pb2.GenerateRequest(
                prompt=turn, bypass_cache=True,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2,
                                                   ignore_eos=True)))
            finished.acquire()

    finished = threading.Semaphore(0)
    with grpc.insecure_channel(kv_mesh.ingress_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for message in stub.GenerateStream(starts(), timeout=120):
            if message.response.finish_reason:
                finished.release()
    after = engine_requests(kv_mesh)
    assert sorted(after[n] - middle[n] for n in after) == [0, 4]


def test_redis_outage_costs_no_request_and_hits_resume(kv_mesh: Mesh,
                                                       kv_redis: RedisProcess) -> None:
    hashes, _, _ = served(kv_mesh, system_prompt(404) + "Question: what is a harbor?\nAnswer:")
    kv_redis.kill()
    try:
        prompts = [f"Say a number: {i}" for i in range(50)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: ask(kv_mesh.ingress_address, p, 2), prompts))
        assert len(answers) == 50  # no client error (ask raises on one)
        assert score(kv_mesh, hashes) == {}
    finally:
        kv_redis.restart()
    # The engines resend snapshots once the index asks: the prompt hits again.
    scores, waited = wait_for(lambda: score(kv_mesh, hashes), timeout=10.0, poll=0.2)
    # 0.6-1.4 s here; CI once saw none after 10 s: the logs say where it stuck.
    assert scores, ("no index entries 10 s after Redis came back\n"
                    + "\n".join(f"--- {name}\n{log_tail(kv_mesh.services[name].log_path, 15)}"
                                for name in ("cache", "engine-0", "engine-1"))
                    + f"\n--- redis\n{kv_redis.log_tail()}")
    print(f"index entries back {waited:.2f} s after Redis restarted")


def test_a_killed_replica_leaves_the_index_within_2_s(kv_mesh: Mesh) -> None:
    hashes, replica, _ = served(
        kv_mesh, system_prompt(505) + "Question: what is a lantern?\nAnswer:")
    name = engine_named(kv_mesh, replica)
    process = kv_mesh.services[name].process
    assert process is not None
    process.kill()
    gone, waited = wait_for(lambda: replica not in score(kv_mesh, hashes), timeout=5.0)
    assert gone and waited < 2.0, f"{replica} still indexed after {waited:.2f} s"
    kv_mesh.restart(name)


# Last in the module: it leaves both replicas' caches and step profiles
# unlike fresh ones (the tests above expect replicas as they were).
def test_kv_aware_gets_3x_the_prefix_hits_of_round_robin(kv_mesh: Mesh) -> None:
    # Two at a time, each pair on two different documents, every document
    # coming back every 4 requests: round robin hands each replica all four
    # documents in turn (two fit in its cache: LRU keeps none of them), while
    # kv_aware keeps each document on one replica. (With a uniformly random
    # order instead, LRU keeps half of round robin's hits: ~1.7x, see
    # docs/architecture.md "Routing across replicas".)
    # kv_aware runs first, on caches that hold none of these documents (the
    # module's other prompts share no block with them); round robin runs second,
    # on the blocks kv_aware left: any hit that gives it only makes the 3x
    # harder to reach, and the engines need no restart (two model loads).
    systems = [system_prompt(10 + i) for i in range(4)]
    pattern = [0, 1, 2, 3, 1, 0, 3, 2] * 5  # 40 questions, as issue 15 asks
    prompts = [systems[p] + f"Question {i}: which word repeats?\nAnswer:"
               for i, p in enumerate(pattern)]
    hashes = [prompt_hashes(kv_mesh, system) for system in systems]
    assert not any(score(kv_mesh, h) for h in hashes)  # nobody holds them yet
    kv = kv_mesh.add_router("router-kv", ["--routing-policy", "kv_aware"])
    kv_answers = run_workload(kv.grpc_address, prompts)
    rr = kv_mesh.add_router("router-rr", ["--routing-policy", "round_robin"])
    rr_answers = run_workload(rr.grpc_address, prompts)
    rr_hits = sum(cached for _, cached in rr_answers)
    kv_hits = sum(cached for _, cached in kv_answers)
    print(f"prefix-hit tokens: kv_aware {kv_hits}, round_robin {rr_hits}")
    assert kv_hits >= 3 * max(rr_hits, 1)
    assert [text for text, _ in kv_answers] == [text for text, _ in rr_answers]
    routed = metric_sum(kv.metrics_address, "llmesh:router_routed_requests_total")
    assert routed == len(prompts)
