"""services.bench.datasets with SmolLM2's own tokenizer: exact lengths, determinism, shapes."""

from __future__ import annotations

import json

import pytest

from services.bench.datasets import (
    BenchRequest,
    ChatScript,
    Conversation,
    TextSampler,
    conversation_requests,
    corpus_sentences,
    load_conversations,
    load_questions,
    random_requests,
    shared_prefix_requests,
    synthetic_chats,
)
from services.bench.tokenizer import BenchTokenizer, Message

pytestmark = pytest.mark.model


def test_bundled_data_is_present_and_sane() -> None:
    sentences = corpus_sentences()
    assert len(sentences) > 100
    assert all(s[-1] in ".!?" for s in sentences)
    questions = load_questions()
    assert len(questions) >= 20 and all(q.strip() for q in questions)
    conversations = load_conversations()
    assert len(conversations) >= 10
    assert len({c.id for c in conversations}) == len(conversations)
    assert all(len(c.turns) >= 2 and all(u and a for u, a in c.turns) for c in conversations)


@pytest.mark.parametrize("length", [1, 2, 7, 32, 256, 3000])
def test_random_prompts_have_exactly_the_requested_tokens(bench_tokenizer: BenchTokenizer,
                                                          length: int) -> None:
    requests = random_requests(bench_tokenizer, 20, length, 16, seed=length)
    assert len(requests) == 20
    for request in requests:
        assert request.prompt is not None and request.messages is None
        assert len(bench_tokenizer.encode(request.prompt)) == length == request.prompt_len
        assert request.output_len == 16
    if length >= 32:
        assert len({r.prompt for r in requests}) == 20


def test_random_prompts_are_real_text_and_repeat_with_the_seed(
        bench_tokenizer: BenchTokenizer) -> None:
    one = random_requests(bench_tokenizer, 5, 64, 8, seed=3)
    assert one == random_requests(bench_tokenizer, 5, 64, 8, seed=3)
    assert one != random_requests(bench_tokenizer, 5, 64, 8, seed=4)
    corpus = " ".join(corpus_sentences())
    first_words = one[0].prompt.split()[:6]  # type: ignore[union-attr]
    assert " ".join(first_words) in corpus


def test_random_range_ratio_spreads_lengths(bench_tokenizer: BenchTokenizer) -> None:
    requests = random_requests(bench_tokenizer, 200, 40, 20, seed=0, range_ratio=0.5)
    inputs = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert min(inputs) >= 20 and max(inputs) <= 60 and len(set(inputs)) > 10
    assert min(outputs) >= 10 and max(outputs) <= 30
    for request in requests[:20]:
        assert len(bench_tokenizer.encode(request.prompt)) == request.prompt_len  # type: ignore
    with pytest.raises(ValueError):
        random_requests(bench_tokenizer, 1, 8, 8, range_ratio=1.0)


def test_sampler_on_custom_text(bench_tokenizer: BenchTokenizer) -> None:
    import numpy as np

    sampler = TextSampler(bench_tokenizer, ["One short sentence.", "Another one here!"])
    text, count = sampler.sample(np.random.default_rng(0), 50)
    assert count == 50 == len(bench_tokenizer.encode(text))
    with pytest.raises(ValueError):
        sampler.sample(np.random.default_rng(0), 0)


def test_shared_prefix_requests_share_a_few_long_system_prompts(
        bench_tokenizer: BenchTokenizer) -> None:
    requests = shared_prefix_requests(bench_tokenizer, 24, num_prefixes=3, prefix_len=200,
                                      output_len=12, seed=5)
    assert len(requests) == 24
    systems: dict[str, list[BenchRequest]] = {}
    for request in requests:
        assert request.prompt is None and request.messages is not None
        system, user = request.messages
        assert system.role == "system" and user.role == "user"
        assert user.content in load_questions()
        systems.setdefault(system.content, []).append(request)
        assert request.tag == f"shared-prefix/{request.tag.rsplit('/', 1)[1]}"
        assert request.output_len == 12
        rendered = bench_tokenizer.render_chat(request.messages)
        assert request.prompt_len == len(bench_tokenizer.encode(rendered))
    assert len(systems) == 3
    assert sorted(len(v) for v in systems.values()) == [8, 8, 8]
    for content in systems:
        assert len(bench_tokenizer.encode(content)) == 200
    assert [r.tag for r in requests] != sorted(r.tag for r in requests)  # shuffled


def test_conversations_go_round_by_round_with_history(bench_tokenizer: BenchTokenizer) -> None:
    conversations = load_conversations()
    total = sum(len(c.turns) for c in conversations)
    requests = conversation_requests(bench_tokenizer, total + 5, seed=1)
    assert len(requests) == total + 5
    firsts = requests[:len(conversations)]
    assert all(r.tag.endswith("/0") for r in firsts)
    assert {r.tag.split("/")[1] for r in firsts} == {c.id for c in conversations}
    assert requests[total:] == requests[:5]  # the set repeats
    by_id = {c.id: c for c in conversations}
    for request in requests[:total]:
        _, conv_id, turn = request.tag.split("/")
        conv, k = by_id[conv_id], int(turn)
        messages = request.messages
        assert messages is not None
        expected = [Message("system", conv.system)] if conv.system else []
        for user, assistant in conv.turns[:k]:
            expected += [Message("user", user), Message("assistant", assistant)]
        expected.append(Message("user", conv.turns[k][0]))
        assert list(messages) == expected
        assert request.output_len == len(bench_tokenizer.encode(conv.turns[k][1]))
        assert request.prompt_len == len(bench_tokenizer.encode(
            bench_tokenizer.render_chat(messages)))


def test_conversations_from_a_file_and_fixed_output_len(bench_tokenizer: BenchTokenizer,
                                                        tmp_path) -> None:
    path = tmp_path / "convs.json"
    path.write_text(json.dumps({"conversations": [
        {"id": "x", "turns": [{"user": "Hi?", "assistant": "Hello."},
                              {"user": "Bye?", "assistant": "Bye."}]}]}))
    loaded = load_conversations(path)
    assert loaded == [Conversation("x", "", (("Hi?", "Hello."), ("Bye?", "Bye.")))]
    requests = conversation_requests(bench_tokenizer, 3, output_len=9, conversations=loaded)
    assert [r.tag for r in requests] == ["conversations/x/0", "conversations/x/1",
                                         "conversations/x/0"]
    assert all(r.output_len == 9 for r in requests)


def test_synthetic_chats_share_one_system_prompt_and_have_exact_lengths(
        bench_tokenizer: BenchTokenizer) -> None:
    chats = synthetic_chats(bench_tokenizer, 12, turns=3, system_len=100, turn_len=40,
                            output_len=7, seed=2)
    assert [c.id for c in chats] == [f"c{i:02d}" for i in range(12)]
    assert len({c.system for c in chats}) == 1
    assert len(bench_tokenizer.encode(chats[0].system)) == 100
    turns = [u for c in chats for u in c.user_turns]
    assert all(len(c.user_turns) == 3 and c.output_len == 7 for c in chats)
    assert all(len(bench_tokenizer.encode(u)) == 40 for u in turns)
    assert len(set(turns)) == len(turns)
    same = synthetic_chats(bench_tokenizer, 12, turns=3, system_len=100, turn_len=40,
                           output_len=7, seed=2)
    assert same == chats
    other = synthetic_chats(bench_tokenizer, 12, turns=3, system_len=100, turn_len=40,
                            output_len=7, seed=3)
    assert other[0].system != chats[0].system and other[0].user_turns != chats[0].user_turns
    with pytest.raises(ValueError, match="turn_len"):
        synthetic_chats(bench_tokenizer, 1, turns=1, system_len=1, turn_len=0, output_len=1)


def test_a_chat_turn_carries_the_replies_given_before_it(bench_tokenizer: BenchTokenizer) -> None:
    chat = ChatScript("c1", "Be brief.", ("First?", "Second?", "Third?"), 5)
    first = chat.request(bench_tokenizer, [])
    assert first.messages == (Message("system", "Be brief."), Message("user", "First?"))
    assert (first.tag, first.turn, first.output_len) == ("conversations/c1/0", 0, 5)
    third = chat.request(bench_tokenizer, ["Reply one.", "Reply two."])
    assert third.messages == (
        Message("system", "Be brief."), Message("user", "First?"),
        Message("assistant", "Reply one."), Message("user", "Second?"),
        Message("assistant", "Reply two."), Message("user", "Third?"))
    assert (third.tag, third.turn) == ("conversations/c1/2", 2)
    assert third.prompt_len == len(bench_tokenizer.encode(bench_tokenizer.render_chat(
        third.messages)))
    # As with a chat client, the next turn's prompt starts with the previous
    # prompt and the reply generated for it: what the engine's prefix cache holds.
    second = chat.request(bench_tokenizer, ["Reply one."])
    assert second.messages is not None and third.messages is not None
    assert bench_tokenizer.render_chat(third.messages).startswith(
        bench_tokenizer.render_chat(second.messages) + "Reply two.")
    with pytest.raises(ValueError, match="no turn 3"):
        chat.request(bench_tokenizer, ["a", "b", "c"])


def test_bench_request_checks_its_fields() -> None:
    with pytest.raises(ValueError):
        BenchRequest(None, None, 1, 1)
    with pytest.raises(ValueError):
        BenchRequest("a", (Message("user", "a"),), 1, 1)
    with pytest.raises(ValueError):
        BenchRequest("a", None, 1, 0)
