"""History compaction with retrieval in the router, over real gRPC against the
fake tokenizer / engine / retriever and the real cache service in process
(tests/router/router_fakes.py; one character is one token): a summary never
folds in the passages the router inserted for one request, and the passages
of a compacted chat go after the summary prefix, just before the last user
turn. The real mesh: tests/e2e/test_mesh_history.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from llmesh.v1 import common_pb2, generation_pb2
from services.cache.metrics import CacheMetrics
from services.cache.service import CacheService
from services.cache.store import MemoryStore
from services.router.history.conversation import SUMMARY_HEADER
from services.router.history.settings import HistorySettings
from tests.router.router_fakes import FakeChunk, decode, template
from tests.router.test_router_retrieval import rag_mesh
from tests.router.test_router_service import collect, greedy, text_of, wait_for

#: Long passages: the current exchange alone passes the low-water mark, so a
#: compaction would fold the passages in if it could.
LONG = [FakeChunk(f"notes#{i}", f"Note {i}: " + "the river is wide and slow here. " * 3)
        for i in range(3)]
SYSTEM = common_pb2.ChatMessage(role="system", content="Answer briefly.")
BUDGET = 800


def message(role: str, content: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=role, content=content)


async def test_passages_are_never_summarised_and_follow_the_summary_prefix() -> None:
    cache = CacheService(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    async with rag_mesh(cache_servicer=cache, history=HistorySettings(
            budgets={"": BUDGET}, summary_max_tokens=16)) as (mesh, retriever, _):
        retriever.collections["long"] = LONG
        engine = mesh.engines[0]
        history: list[common_pb2.ChatMessage] = []  # the client's: no passages
        finals: list[generation_pb2.GenerateResponse] = []
        for number in range(4):
            history.append(message("user", f"Question {number}: " + "what now? " * 3))
            request = generation_pb2.GenerateRequest(
                chat=generation_pb2.Chat(messages=[SYSTEM, *history]),
                sampling=greedy(max_tokens=64))
            request.retrieval.CopyFrom(generation_pb2.Retrieval(collection="long", top_k=3))
            responses = await collect(mesh.stub.Generate(request))
            finals.append(responses[-1])
            history.append(message("assistant", text_of(responses)))
            await wait_for(lambda: not mesh.metric("llmesh:history_compactions_running",
                                                   model_name="fake-model"), timeout=5)
        summaries = [decode(s.prompt_token_ids) for s in engine.log.starts
                     if s.request_id.endswith(".history")]
        assert summaries and not any("Passages retrieved" in s for s in summaries)
        # The third turn passed the high-water mark: its summary covers the
        # client's two earlier exchanges, and the fourth turn finds it.
        assert finals[3].usage.history_turns_summarized == 4
        prompt = decode([s for s in engine.log.starts
                         if not s.request_id.endswith(".history")][-1].prompt_token_ids)
        system, rest = prompt.split("\n<user>", 1)
        assert system.startswith(f"<system>{SYSTEM.content}\n\n{SUMMARY_HEADER}\n")
        passages = finals[3].retrieval.passages_message
        # then the turns the summary does not cover, the passages, the question
        assert "<user>" + rest == template([*history[4:6], message("user", passages),
                                            history[6]])
