"""Summarised history on the session mesh: two extra routers with a 384-token
history budget (one cache service, so one summary store), driven through their
OpenAI endpoints with a short chat: the stable summary prefix and its prefix
cache reuse, incremental compaction, the per-request switch, and one summary
per compaction whatever the number of routers."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from services.cli.mesh import Mesh, ServiceProcess

pytestmark = pytest.mark.mesh

BUDGET = 384
SUMMARY_TOKENS = 32
ARGS = [f"--history-budget-tokens={BUDGET}", f"--history-summary-max-tokens={SUMMARY_TOKENS}"]
FACTS = ["My name is Ada and I live in Lisbon with two cats. I moved there four years ago.",
         "I work as a bridge engineer and I like long walks along the river after work.",
         "My sister Eva is visiting next Tuesday from Berlin. She stays for ten days.",
         "We plan to cook fish and rice with lemon for dinner, and a cake for dessert.",
         "I am learning to play the cello every morning before breakfast, for an hour.",
         "My favourite number is seven and my car is green. It is an old small car.",
         "Next month I travel to Porto by train for work. The trip takes three hours.",
         "The cats are called Tom and Mia; Mia is older and sleeps on the sofa all day.",
         "I drink green tea and never coffee after noon, because I sleep badly otherwise.",
         "My office is on the fifth floor near the river, with a view of the old bridge.",
         "On Sundays I visit the old market with Eva to buy fruit, bread and flowers.",
         "I want to paint the kitchen blue this summer, and buy a new wooden table."]


@pytest.fixture(scope="module")
def routers(mesh: Mesh) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    first = mesh.add_router("router-history-a", ARGS)
    second = mesh.add_router("router-history-b", ARGS)
    yield first, second
    stops = [threading.Thread(target=mesh.remove_router, args=(r.name,))
             for r in (first, second)]  # their drains overlap
    for stop in stops:
        stop.start()
    for stop in stops:
        stop.join()


def client_of(router: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.extra_ports['openai_port']}/v1",
                         api_key="unused", max_retries=0, timeout=120)


def metric(router: ServiceProcess, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    text = urllib.request.urlopen(f"http://{router.metrics_address}/metrics",
                                  timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series
                                                 for k, v in labels.items()):
            total += float(value)
    return total


def log_tail(router: ServiceProcess) -> str:
    """The router's last log lines, for a failure's message."""
    return "\n".join(router.log_path.read_text(errors="replace").splitlines()[-20:])


def settle(*routers: ServiceProcess) -> None:
    """Waits until no compaction runs in any of ``routers``."""
    deadline = time.monotonic() + 60
    while any(metric(r, "llmesh:history_compactions_running") for r in routers):
        assert time.monotonic() < deadline, "a compaction ran for over 60 s"
        time.sleep(0.05)


def turn(client: openai.OpenAI, model: str, messages: list[dict[str, str]],
         **extra: Any) -> dict[str, Any]:
    """One greedy chat turn; the answer is appended to ``messages``; returns the usage."""
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                           temperature=0, extra_body=extra or None)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert reply.usage is not None
    return reply.usage.model_dump()


def test_history_is_summarised_with_a_stable_prefix(
        routers: tuple[ServiceProcess, ServiceProcess], model: str) -> None:
    router = routers[0]
    messages = [{"role": "system", "content": "You are a friendly assistant."}]
    usages, compactions = [], []
    with client_of(router) as client:
        for fact in FACTS:
            messages.append({"role": "user", "content": fact})
            usages.append(turn(client, model, messages))
            settle(router)
            compactions.append(metric(router, "llmesh:history_compactions_total"))
            assert usages[-1]["prompt_tokens"] <= BUDGET
        summarized = [u.get("history", {}).get("turns_summarized", 0) for u in usages]
        # compactions happened, and later ones covered more turns
        assert summarized[0] == 0 and len({s for s in summarized if s}) >= 2, (
            summarized, compactions, log_tail(router))
        assert all(u["history"]["tokens_saved"] > 0 for u in usages if "history" in u)
        # between compactions each prompt starts with the previous one (system
        # turn + summary + the turns since), which the engine reuses; a turn
        # that crossed the budget again (and started a compaction) is trimmed
        crossed = [i > 0 and compactions[i] > compactions[i - 1] for i in range(len(FACTS))]
        reused = [i for i in range(1, len(FACTS))
                  if summarized[i] == summarized[i - 1] > 0 and not crossed[i]]
        assert reused, (summarized, crossed)
        for i in reused:
            cached = usages[i]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= usages[i - 1]["prompt_tokens"] - 32, (usages[i - 1], usages[i])
        # the switch: trimmed to the budget only, no summary used or made
        messages.append({"role": "user", "content": "What is my name?"})
        plain = turn(client, model, messages, history={"summarize": False})
        settle(router)
        assert "history" not in plain and plain["prompt_tokens"] <= BUDGET
        assert metric(router, "llmesh:history_compactions_total") == compactions[-1]
        # incremental: each summary read only the turns after the previous one,
        # so the turns read in all equal the turns the latest summary covers
        read = metric(router, "llmesh:history_summarized_turns_total")
        messages.append({"role": "user", "content": "And where do I live?"})
        assert turn(client, model, messages)["history"]["turns_summarized"] == read
        settle(router)


def test_two_routers_write_one_summary(routers: tuple[ServiceProcess, ServiceProcess],
                                       model: str) -> None:
    first, second = routers
    messages = [{"role": "system", "content": "You are a careful note taker."}]
    with client_of(first) as a, client_of(second) as b:
        for fact in FACTS[:9]:  # past the budget, without compaction
            messages.append({"role": "user", "content": fact})
            turn(a, model, messages, history={"summarize": False})
        stored = [metric(r, "llmesh:history_compactions_total", outcome="stored")
                  for r in routers]
        messages.append({"role": "user", "content": FACTS[9]})
        threads = [threading.Thread(target=turn, args=(c, model, list(messages)))
                   for c in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        settle(first, second)
        after = [metric(r, "llmesh:history_compactions_total", outcome="stored")
                 for r in routers]
        outcomes = {o: [metric(r, "llmesh:history_compactions_total", outcome=o)
                        for r in routers] for o in ("stored", "claimed_elsewhere", "failed")}
        assert sum(after) - sum(stored) == 1, (  # one summary for the two routers
            stored, outcomes, log_tail(first), log_tail(second))
        # either router finds it on the next turn
        messages.append({"role": "assistant", "content": "Noted."})
        messages.append({"role": "user", "content": FACTS[10]})
        for client in (a, b):
            usage = turn(client, model, list(messages))
            assert usage["history"]["turns_summarized"] > 0


def test_the_current_exchange_is_kept_whole_past_the_budget(
        routers: tuple[ServiceProcess, ServiceProcess], model: str) -> None:
    """QA: a message longer than the budget was refused ("does not fit the
    context window ... more than max_prompt_tokens=384"), and a turn with
    retrieval passages (a user message before the last one) lost them. The
    budget drops earlier turns only; the current exchange fits the context."""
    long = "Please read this: " + "the quick brown fox jumps over the lazy dog. " * 50
    with client_of(routers[0]) as client:
        for extra in ({}, {"history": {"summarize": False}}):
            usage = turn(client, model, [{"role": "user", "content": long}], **extra)
            assert usage["prompt_tokens"] > BUDGET, usage
        passages = [{"role": "user", "content": long},
                    {"role": "user", "content": "What animal jumps?"}]
        assert turn(client, model, passages)["prompt_tokens"] > BUDGET
    settle(routers[0])
