"""History compaction's pure parts: flags, the conversation split, prefix
hashes, the prompt rewrite, the compaction plan and the summariser's prompt."""

from __future__ import annotations

import argparse

import pytest

from services.common.sampling import Priority, SamplingOptions
from services.common.wire.chat import ChatMessage
from services.router.history.conversation import (
    SUMMARY_HEADER,
    Boundary,
    boundaries,
    rewrite,
    split,
)
from services.router.history.plan import compaction_due, compaction_end, low_water_tokens
from services.router.history.settings import HistorySettings, parse_budget
from services.router.history.summarizer import summary_request, transcript
from services.router.validation import GenerationRequest

SYS = ChatMessage("system", "Be brief.")


def chat(*contents: str) -> tuple[ChatMessage, ...]:
    """user, assistant, user, ... turns."""
    return tuple(ChatMessage("user" if i % 2 == 0 else "assistant", c)
                 for i, c in enumerate(contents))


def test_budget_flag_and_settings() -> None:
    assert parse_budget("256") == ("", 256)
    assert parse_budget("smol=1024") == ("smol", 1024)
    for bad in ("0", "x=", "smol=abc", "-3"):
        with pytest.raises(ValueError, match="history-budget-tokens"):
            parse_budget(bad)
    settings = HistorySettings(budgets={"": 512, "big": 2048}, summary_max_tokens=64)
    assert (settings.budget("big"), settings.budget("other")) == (2048, 512)
    assert HistorySettings().budget("any") == 0  # off by default
    assert settings.summarizer("big") == "big"
    assert HistorySettings(summarizer_model="small").summarizer("big") == "small"
    with pytest.raises(ValueError, match="must exceed"):
        HistorySettings(budgets={"": 64}, summary_max_tokens=64)


def test_split_keeps_leading_system_turns() -> None:
    conversation = split((SYS, *chat("a", "b", "c")))
    assert conversation.system == (SYS,)
    assert [m.content for m in conversation.turns] == ["a", "b", "c"]
    assert split(chat("a")).system == ()


def test_boundaries_sit_before_user_turns_and_chain() -> None:
    conversation = split((SYS, *chat("a", "b", "c", "d", "e")))
    found = boundaries(conversation, model="m", summarizer="m")
    assert [b.end for b in found] == [2, 4]  # before "c" and "e"; never the last turn
    longer = boundaries(split((SYS, *chat("a", "b", "c", "d", "e", "f", "g"))),
                        model="m", summarizer="m")
    assert longer[:2] == found  # the same prefix, the same hash, in any router
    assert [b.end for b in longer] == [2, 4, 6]
    edited = boundaries(split((SYS, *chat("a", "B", "c", "d", "e"))), model="m",
                        summarizer="m")
    assert all(x.prefix_hash != y.prefix_hash for x, y in zip(found, edited, strict=True))
    other_system = boundaries(split((ChatMessage("system", "Be long."), *chat("a", "b", "c"))),
                              model="m", summarizer="m")
    assert other_system[0].prefix_hash != found[0].prefix_hash
    assert boundaries(conversation, model="m", summarizer="s")[0] != found[0]
    assert all(len(b.prefix_hash) == 32 for b in found)


def test_rewrite_puts_the_summary_in_the_system_turn() -> None:
    conversation = split((SYS, *chat("a", "b", "c", "d", "e")))
    assert rewrite(conversation, "", 0) == (SYS, *conversation.turns)
    rewritten = rewrite(conversation, " They met. ", 4)
    assert rewritten[0] == ChatMessage("system", f"Be brief.\n\n{SUMMARY_HEADER}\nThey met.")
    assert rewritten[1:] == conversation.turns[4:]
    alone = rewrite(split(chat("a", "b", "c")), "S", 2)
    assert alone[0] == ChatMessage("system", f"{SUMMARY_HEADER}\nS")
    assert [m.content for m in alone[1:]] == ["c"]


def test_compaction_end_reaches_the_low_water_mark() -> None:
    candidates = [Boundary(2, b"a" * 32), Boundary(4, b"b" * 32), Boundary(6, b"c" * 32)]
    assert compaction_end(candidates, 0, 3) == candidates[1]  # first boundary >= 3
    assert compaction_end(candidates, 2, 1) == candidates[1]  # after the stored summary
    assert compaction_end(candidates, 0, 9) == candidates[2]  # never that low: all but the last
    assert compaction_end(candidates, 6, 7) is None
    assert low_water_tokens(1024, 128) == 384
    assert not compaction_due(768, 0, 1024) and compaction_due(769, 0, 1024)
    assert compaction_due(100, 2, 1024)  # trimmed
    assert low_water_tokens(200, 150) == 1


def test_summary_request_is_greedy_batch_and_incremental() -> None:
    origin = GenerationRequest(request_id="r1", model="big", prompt=None, messages=chat("x"),
                               sampling=SamplingOptions(temperature=0.9), priority=Priority.INTERACTIVE,
                               tenant="t", cache_scope="scope")
    turns = chat("My name is Ada.", "Hello Ada.")
    request = summary_request(origin, model="small", previous="Ada likes tea.", turns=turns,
                              max_tokens=64)
    assert (request.model, request.priority, request.sampling.temperature) == (
        "small", Priority.BATCH, 0.0)
    assert request.sampling.max_tokens == 64
    assert (request.tenant, request.cache_scope) == ("t", "scope")
    assert request.history_exempt and request.summarize_history is None
    assert request.messages is not None and request.messages[0].role == "system"
    text = request.messages[1].content
    assert text == transcript("Ada likes tea.", turns)
    assert "Summary so far:\nAda likes tea." in text
    assert "User: My name is Ada.\nAssistant: Hello Ada." in text
    assert "Summary so far" not in transcript("", turns)


def test_openai_history_switch() -> None:
    from services.common.sampling import InvalidRequestError
    from services.router.openai_protocol import Endpoint, parse_body

    body = {"messages": [{"role": "user", "content": "hi"}]}
    off = parse_body(Endpoint.CHAT, {**body, "history": {"summarize": False}})
    assert off.generate.history.HasField("summarize") and off.generate.history.summarize is False
    assert not parse_body(Endpoint.CHAT, body).generate.HasField("history")
    for bad, where in (("no", "history"), ({"budget": 3}, "history.budget"),
                       ({"summarize": "no"}, "history.summarize")):
        with pytest.raises(InvalidRequestError) as err:
            parse_body(Endpoint.CHAT, {**body, "history": bad})
        assert err.value.field == where


def test_llmesh_up_passes_the_history_flags_to_the_router() -> None:
    from services.cli.main import build_parser
    from services.router.__main__ import build_parser as router_parser
    from services.router.history.flags import history_settings, router_flags

    args = build_parser().parse_args(["up", "--history-budget-tokens", "smol=512",
                                      "--history-budget-tokens", "2048",
                                      "--history-summarizer-model", "small"])
    flags = router_flags(args)
    assert flags == ["--history-budget-tokens=smol=512", "--history-budget-tokens=2048",
                     "--history-summarizer-model=small"]
    routed = router_parser().parse_args(["--tokenizer", "t:1", "--engine", "e:1", *flags])
    settings = history_settings(routed)
    assert (settings.budget("smol"), settings.budget("other")) == (512, 2048)
    assert settings.summarizer("smol") == "small" and settings.summary_max_tokens == 128


def test_llmesh_up_refuses_bad_history_flags_before_starting() -> None:
    """QA: a summary size of -5 failed only once the engines had started, and a
    budget or summariser naming no served model started silently."""
    from services.router.history.flags import add_history_arguments, problem

    parser = argparse.ArgumentParser()
    add_history_arguments(parser)

    def check(*argv: str) -> str | None:
        return problem(parser.parse_args(list(argv)), ["small", "large"])

    assert check("--history-budget-tokens", "small=512") is None
    assert ">= 1" in (check("--history-summary-max-tokens", "-5") or "")
    assert "['nope']" in (check("--history-budget-tokens", "nope=512") or "")
    assert "['nope']" in (check("--history-summarizer-model", "nope") or "")
    assert problem(parser.parse_args(["--history-budget-tokens", "nope=512"]), []) is None
