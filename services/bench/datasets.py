"""The benchmark's prompts: ``random``, ``shared-prefix`` and ``conversations``.

Every prompt is real English: the text in ``data/corpus.txt``, written for
this project, cut to an exact number of tokens with the model's tokenizer.
Nothing here is copied from a public data set.

- ``random``: for each request, text from a random token of a random
  sentence of the corpus, then whole sentences drawn at random (with
  replacement) until ``input_len`` tokens, cut to exactly that many;
  ``output_len`` tokens requested. A random start (about 3,000 possible) and
  random sentences after it keep two prompts from sharing a long prefix by
  chance, so prefix caches do not flatter the figures.
- ``shared-prefix``: ``num_prefixes`` long system prompts (corpus text of
  ``prefix_len`` tokens each), each followed by many short questions from
  ``data/questions.json``, as chat; requests are shuffled. Measures prefix
  (KV) reuse.
- ``conversations``: the multi-turn conversations in
  ``data/conversations.json``; one request per user turn, carrying the
  history before it (earlier user turns and their reference replies) as chat.
  Requests go out round by round (every conversation's first turn, then every
  second turn ...), and the whole set repeats until ``num_prompts``. The
  requested output length is the reference reply's token count.
- ``conversations`` with ``--conversations-num``: synthetic chats
  (:func:`synthetic_chats`), one shared system prompt of ``system_len``
  tokens and ``turns`` user turns of ``turn_len`` tokens each; the replies
  are the model's own, so each turn's request is built while the benchmark
  runs (:meth:`ChatScript.request`, driven by
  :func:`services.bench.load.run_chats`).

Prompt lengths (``BenchRequest.prompt_len``) are counted with the same
tokenizer: the raw text for a prompt, the rendered chat template (with the
generation prompt) for chat.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from services.bench.tokenizer import BenchTokenizer, Message

DATASET_NAMES = ("random", "shared-prefix", "conversations")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a benchmark, independent of the target.

    Exactly one of ``prompt`` (raw text, no template) and ``messages`` (chat)
    is set.

    Attributes:
      prompt: raw prompt text.
      messages: chat turns, oldest first, ending with a user turn.
      prompt_len: prompt tokens by the bench tokenizer (chat: the rendered
        template with the generation prompt).
      output_len: completion tokens to ask for (``max_tokens``).
      tag: where it came from, e.g. ``random/3``, ``shared-prefix/1``,
        ``conversations/bread/2``.
      turn: the user turn of a conversation it asks for, 0-based (0: the
        conversation's first request); ``None`` outside conversations.
    """

    prompt: str | None
    messages: tuple[Message, ...] | None
    prompt_len: int
    output_len: int
    tag: str = ""
    turn: int | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be set")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


def _data_text(name: str) -> str:
    return resources.files("services.bench").joinpath("data", name).read_text("utf-8")


def corpus_sentences(text: str | None = None) -> list[str]:
    """The corpus split into sentences (default: the bundled ``data/corpus.txt``)."""
    text = _data_text("corpus.txt") if text is None else text
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    return [s.strip() for s in sentences if s.strip()]


class TextSampler:
    """Cuts real text to an exact token count.

    Args:
      tokenizer: the model's tokenizer.
      sentences: the text to draw from (default: the bundled corpus).
    """

    def __init__(self, tokenizer: BenchTokenizer, sentences: Sequence[str] | None = None) -> None:
        self._tokenizer = tokenizer
        sentences = list(sentences) if sentences is not None else corpus_sentences()
        if not sentences:
            raise ValueError("no sentences to draw prompts from")
        # Each sentence encoded with its leading space, as it appears mid-text.
        self._sentence_ids = [tokenizer.encode(" " + s) for s in sentences]

    def _draw_ids(self, rng: np.random.Generator, count: int, *, first: bool = False
                  ) -> list[int]:
        ids: list[int] = []
        if first:  # start anywhere inside a sentence: ~3,000 distinct starts, not ~150
            sentence = self._sentence_ids[int(rng.integers(len(self._sentence_ids)))]
            ids = sentence[int(rng.integers(len(sentence))):]
        while len(ids) < count:
            ids += self._sentence_ids[int(rng.integers(len(self._sentence_ids)))]
        return ids

    def sample(self, rng: np.random.Generator, num_tokens: int) -> tuple[str, int]:
        """Text of random sentences that encodes to ``num_tokens`` tokens.

        Decoding a cut and encoding it again may merge or split tokens at the
        cut; the text is re-cut (or extended) until the count holds, which
        takes one or two rounds in practice.

        Returns:
          ``(text, token_count)``; the count equals ``num_tokens`` unless
          retokenization never settled (then it is the text's real count).
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        tokenizer = self._tokenizer
        ids = self._draw_ids(rng, num_tokens, first=True)[:num_tokens]
        text = tokenizer.decode(ids).lstrip()
        for _ in range(16):
            ids = tokenizer.encode(text)
            if len(ids) == num_tokens:
                return text, num_tokens
            if len(ids) > num_tokens:
                ids = ids[:num_tokens]
            else:
                ids = ids + self._draw_ids(rng, num_tokens - len(ids))
                ids = ids[:num_tokens]
            text = tokenizer.decode(ids)
        return text, len(tokenizer.encode(text))


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> list[int]:
    """``count`` lengths uniform in ``[mean*(1-r), mean*(1+r)]``, at least 1 (as vLLM's)."""
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [int(v) for v in rng.integers(low, high + 1, size=count)]


def random_requests(tokenizer: BenchTokenizer, num_prompts: int, input_len: int,
                    output_len: int, *, seed: int = 0, range_ratio: float = 0.0,
                    sampler: TextSampler | None = None) -> list[BenchRequest]:
    """``num_prompts`` raw prompts of ``input_len`` tokens asking for ``output_len`` tokens.

    Args:
      range_ratio: in [0, 1): lengths are drawn uniformly from
        ``[len*(1-r), len*(1+r)]`` (``--random-range-ratio``).
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    sampler = sampler or TextSampler(tokenizer)
    inputs = _lengths(rng, input_len, range_ratio, num_prompts)
    outputs = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs, strict=True)):
        text, count = sampler.sample(rng, n_in)
        requests.append(BenchRequest(text, None, count, n_out, f"random/{i}"))
    return requests


def load_questions() -> list[str]:
    """The short questions bundled for the shared-prefix workload."""
    return list(json.loads(_data_text("questions.json")))


def shared_prefix_requests(tokenizer: BenchTokenizer, num_prompts: int, *,
                           num_prefixes: int, prefix_len: int, output_len: int,
                           seed: int = 0, questions: Sequence[str] | None = None,
                           sampler: TextSampler | None = None) -> list[BenchRequest]:
    """Chat requests: one of ``num_prefixes`` system prompts of ``prefix_len``
    tokens, then a short question; shuffled.

    Request ``i`` (before the shuffle) uses prefix ``i % num_prefixes``, so
    each prefix gets ``num_prompts / num_prefixes`` questions (±1).
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    sampler = sampler or TextSampler(tokenizer)
    questions = list(questions) if questions is not None else load_questions()
    prefixes = [sampler.sample(rng, prefix_len)[0] for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        p = i % num_prefixes
        question = questions[int(rng.integers(len(questions)))]
        messages = (Message("system", prefixes[p]), Message("user", question))
        prompt_len = len(tokenizer.encode(tokenizer.render_chat(messages)))
        requests.append(BenchRequest(None, messages, prompt_len, output_len,
                                     f"shared-prefix/{p}"))
    order = rng.permutation(len(requests))
    return [requests[int(i)] for i in order]


@dataclass(frozen=True, slots=True)
class Conversation:
    """A bundled conversation: optional system prompt, (user, reply) turns."""

    id: str
    system: str
    turns: tuple[tuple[str, str], ...]


def load_conversations(path: str | Path | None = None) -> list[Conversation]:
    """Conversations from ``path`` (default: the bundled ``data/conversations.json``).

    The file holds ``{"conversations": [{"id", "system", "turns": [{"user",
    "assistant"}, ...]}, ...]}`` (``system`` optional; at least one conversation,
    each with at least one turn; texts are strings).

    Raises:
      ValueError: the file cannot be read, is not JSON or not in that shape
        (one line naming the file and what is wrong).
    """
    where = "the bundled conversations" if path is None else str(path)
    try:
        raw = (Path(path).read_text("utf-8") if path is not None
               else _data_text("conversations.json"))
        data = json.loads(raw)
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ValueError(f"{where}: cannot read it ({reason})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error})") from None
    try:
        conversations = [_conversation(item) for item in data["conversations"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: expected {{\"conversations\": [{{\"id\", \"system\", "
                         f"\"turns\": [{{\"user\", \"assistant\"}}, ...]}}, ...]}} "
                         f"({_shape_error(error)})") from None
    if not conversations:
        raise ValueError(f"{where}: holds no conversation")
    return conversations


def _conversation(item: dict[str, object]) -> Conversation:
    """One conversation of the file (KeyError, TypeError, ValueError: not in its shape)."""
    turns = tuple((_text(t["user"]), _text(t["assistant"]))  # type: ignore[index]
                  for t in item["turns"])  # type: ignore[union-attr]
    if not turns:
        raise ValueError(f"conversation {item.get('id')!r} has no turns")
    return Conversation(str(item["id"]), _text(item.get("system") or ""), turns)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a text is {type(value).__name__}, not a string")
    return value


def _shape_error(error: Exception) -> str:
    return f"no {error} key" if isinstance(error, KeyError) else str(error)


def conversation_requests(tokenizer: BenchTokenizer, num_prompts: int, *, seed: int = 0,
                          output_len: int | None = None,
                          conversations: Sequence[Conversation] | None = None
                          ) -> list[BenchRequest]:
    """One chat request per user turn with its history; round by round; repeated
    until ``num_prompts``.

    Args:
      output_len: tokens to ask for; ``None``: the reference reply's token count.
    """
    rng = np.random.default_rng(seed)
    conversations = list(conversations) if conversations is not None else load_conversations()
    order = [conversations[int(i)] for i in rng.permutation(len(conversations))]
    rounds: list[BenchRequest] = []
    for turn in range(max(len(c.turns) for c in order)):
        for conv in order:
            if turn < len(conv.turns):
                rounds.append(_conversation_turn(tokenizer, conv, turn, output_len))
    return [rounds[i % len(rounds)] for i in range(num_prompts)]


def _conversation_turn(tokenizer: BenchTokenizer, conv: Conversation, turn: int,
                       output_len: int | None) -> BenchRequest:
    messages: list[Message] = [Message("system", conv.system)] if conv.system else []
    for user, assistant in conv.turns[:turn]:
        messages += [Message("user", user), Message("assistant", assistant)]
    messages.append(Message("user", conv.turns[turn][0]))
    reference = conv.turns[turn][1]
    wanted = output_len if output_len is not None else max(1, len(tokenizer.encode(reference)))
    prompt_len = len(tokenizer.encode(tokenizer.render_chat(messages)))
    return BenchRequest(None, tuple(messages), prompt_len, wanted,
                        f"conversations/{conv.id}/{turn}", turn)


@dataclass(frozen=True, slots=True)
class ChatScript:
    """A synthetic conversation: what its user says; the replies come from the
    model while the benchmark runs, as with a real chat client.

    Attributes:
      id: unique in its set, e.g. ``c07``.
      system: the system prompt (the same text for every script of a set).
      user_turns: the user's messages, in order.
      output_len: completion tokens asked for on every turn.
    """

    id: str
    system: str
    user_turns: tuple[str, ...]
    output_len: int

    def request(self, tokenizer: BenchTokenizer, replies: Sequence[str]) -> BenchRequest:
        """The request of turn ``len(replies)``: the system prompt, every earlier
        user turn followed by the reply the model gave to it, then this turn's
        user message.

        Args:
          replies: the model's replies to the turns before, oldest first.

        Raises:
          ValueError: no turn is left (``len(replies) >= len(user_turns)``).
        """
        turn = len(replies)
        if turn >= len(self.user_turns):
            raise ValueError(f"{self.id} has {len(self.user_turns)} turns; no turn {turn}")
        messages = [Message("system", self.system)]
        for user, reply in zip(self.user_turns, replies, strict=False):
            messages += [Message("user", user), Message("assistant", reply)]
        messages.append(Message("user", self.user_turns[turn]))
        prompt_len = len(tokenizer.encode(tokenizer.render_chat(messages)))
        return BenchRequest(None, tuple(messages), prompt_len, self.output_len,
                            f"conversations/{self.id}/{turn}", turn)


def synthetic_chats(tokenizer: BenchTokenizer, num_chats: int, *, turns: int, system_len: int,
                    turn_len: int, output_len: int, seed: int = 0,
                    sampler: TextSampler | None = None) -> list[ChatScript]:
    """``num_chats`` conversations of ``turns`` user turns sharing one system prompt.

    The system prompt is corpus text of exactly ``system_len`` tokens, each
    user turn corpus text of exactly ``turn_len`` tokens (both by
    ``tokenizer``, before the chat template adds its role markers). The same
    arguments give the same scripts.

    Raises:
      ValueError: a count or length below 1.
    """
    for name, value in (("num_chats", num_chats), ("turns", turns), ("system_len", system_len),
                        ("turn_len", turn_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    sampler = sampler or TextSampler(tokenizer)
    system = sampler.sample(rng, system_len)[0]
    width = len(str(num_chats - 1))
    return [ChatScript(f"c{i:0{width}d}", system,
                       tuple(sampler.sample(rng, turn_len)[0] for _ in range(turns)), output_len)
            for i in range(num_chats)]
