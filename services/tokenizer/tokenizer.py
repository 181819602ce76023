"""The model's own tokenizer and chat template, behind a small typed wrapper.

The tokenizer is read from the model's GGUF file by ``transformers``
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, about 4 s for SmolLM2
and 14 s for Gemma 3 here, once: the result is cached on disk by
:mod:`services.common.tokenizer_cache`, under a second afterwards), or from a Hugging Face checkpoint directory
(``AutoTokenizer.from_pretrained(dir)``: one model copy serves the tokenizer,
the torch engine and TensorRT-LLM), so ids and chat prompts are exactly the ones the
model was trained with. Hot paths call the Rust ``tokenizers`` backend directly
(``encode_batch_fast``, ``decode``): the same ids and text as the
``transformers`` wrapper, checked by the tests, at about half the cost.

Chat prompts: only the template's own markup makes control tokens; special-
token text inside a message's content is tokenized as plain text unless the
caller allows it (see :mod:`services.tokenizer.control_tokens`). Roles outside
:data:`DEFAULT_CHAT_ROLES` (or the configured set) are refused.

Thread safety: encode, decode and template rendering only read the tokenizer,
so they may run concurrently from several threads.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.checkpoint import (
    check_tokenizer_path,
    checkpoint_eos_ids,
    is_checkpoint_dir,
    load_hf_tokenizer,
)
from services.common.detokenizer import first_out_of_range
from services.common.wire.chat import ChatMessage, ChatPrompt
from services.common.wire.tokenizer_info import TokenizerInfo
from services.common.wire.tools import FunctionTool
from services.tokenizer.control_tokens import (
    ControlTokens,
    ForgedControlTokenError,
    Skeleton,
    align,
    encode_chat,
    render_skeleton,
)
from services.tokenizer.gguf_meta import GGUFFormatError, read_gguf_scalars

# GGUF keys whose token ids end a generation besides ``eos_token_id``.
_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
# End-of-turn markers of common chat templates (ChatML, Gemma, Llama 3, Phi-3).
# One that appears in the model's template and is a special token ends a turn.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")
#: The chat roles a template accepts unless configured otherwise: OpenAI's chat
#: roles that ChatML-style templates (SmolLM2) and Gemma's (assistant becomes
#: "model") render. A template may still refuse an order of them (Gemma: turns
#: must alternate user/assistant).
DEFAULT_CHAT_ROLES = ("system", "user", "assistant", "tool")
#: A role is a plain name: it is written into the template's markup.
_ROLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")
#: Texts up to this many characters are encoded on the event loop (by the
#: tokenizer service, and by the router's in-process tokenization): 0.15-0.3 µs
#: per character here, so at most ~0.6 ms; longer ones go to a worker thread
#: (a hop costs ~0.1 ms).
DEFAULT_INLINE_ENCODE_MAX_CHARS = 2048
#: Skeletons (template markup per role sequence) kept; each is a few hundred bytes.
_SKELETON_CACHE_SIZE = 1024
_NOT_CACHED = object()
#: A skeleton's key: the messages without contents, add_generation_prompt, the tools.
_SkeletonKey = tuple[tuple[ChatMessage, ...], bool, tuple[FunctionTool, ...]]


def check_chat_roles(roles: Sequence[str]) -> tuple[str, ...]:
    """``roles`` without repeats, in order.

    Raises:
      ValueError: none given, or one is not a plain name (letters, digits,
        ``_``, ``-``; it is written into the template's markup).
    """
    for role in roles:
        if not _ROLE_NAME.fullmatch(role):
            raise ValueError(f"chat role {role!r} is not a plain name "
                             "(letters, digits, '_' or '-', at most 32)")
    if not roles:
        raise ValueError("chat_roles: at least one role is needed")
    return tuple(dict.fromkeys(roles))


class NoChatTemplateError(ValueError):
    """The model has no chat template (a base model): gRPC FAILED_PRECONDITION."""


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (e.g. roles that do not
    alternate), or a message's special-token text cannot be kept as plain text
    under this template: gRPC INVALID_ARGUMENT."""


class UnknownRoleError(ValueError):
    """A message's role is not one of the template's roles: gRPC INVALID_ARGUMENT.

    The message starts with ``messages[i].role`` and lists the allowed roles.
    """


class PromptTooLongError(ValueError):
    """Even the system message(s) plus the last message exceed the token
    budget: gRPC OUT_OF_RANGE.

    Attributes:
      num_tokens: tokens of that smallest prompt.
      max_prompt_tokens: the budget it had to fit.
    """

    def __init__(self, num_tokens: int, max_prompt_tokens: int) -> None:
        super().__init__(
            f"the prompt needs {num_tokens} tokens with only the system message(s) and the "
            f"last message kept, more than max_prompt_tokens={max_prompt_tokens}"
        )
        self.num_tokens = num_tokens
        self.max_prompt_tokens = max_prompt_tokens


class InvalidTokenIdError(ValueError):
    """A token id is negative or not below the vocabulary size: gRPC INVALID_ARGUMENT."""


class Tokenizer:
    """Encode, decode and chat templates of one model.

    Build it with :meth:`load`; the constructor takes an already loaded
    ``transformers`` tokenizer (used by tests and :meth:`load`).
    """

    def __init__(self, hf_tokenizer: Any, model: str, extra_eos_token_ids: Sequence[int] = (),
                 *, chat_template: str | None = None,
                 chat_roles: Sequence[str] = DEFAULT_CHAT_ROLES):
        """Args:
          hf_tokenizer: a fast ``transformers`` tokenizer (``backend_tokenizer`` set).
          model: name reported in :attr:`info`.
          extra_eos_token_ids: end-of-generation ids besides the tokenizer's
            EOS (e.g. the GGUF's ``eot_token_id``).
          chat_template: Jinja chat template to use instead of the model's own
            (e.g. Gemma 3's for a base model that has none).
          chat_roles: the message roles to accept (ignored without a template).

        Raises:
          ValueError: bad ``chat_roles`` (see :func:`check_chat_roles`).
        """
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        # tokenizers >= 0.21; encode_batch also releases the GIL, only slower.
        self._encode_batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        self._template: str | None = chat_template or hf_tokenizer.chat_template or None
        roles = check_chat_roles(chat_roles)
        self._roles = roles if self._template is not None else ()
        # Control tokens of the template's markup (None without a template).
        self._control = (ControlTokens(self._backend, self._template)
                         if self._template is not None else None)
        self._skeletons: dict[_SkeletonKey, Skeleton | None] = {}
        self._skeletons_lock = threading.Lock()
        self._vocab_size = len(hf_tokenizer)
        self._info = TokenizerInfo(
            model=model,
            vocab_size=self._vocab_size,
            eos_token_ids=self._eos_ids(extra_eos_token_ids),
            bos_token_id=hf_tokenizer.bos_token_id,
            has_chat_template=self._template is not None,
            chat_roles=self._roles,
        )

    @classmethod
    def load(cls, model_path: Path, model: str | None = None, *,
             chat_template: str | None = None,
             chat_roles: Sequence[str] = DEFAULT_CHAT_ROLES) -> Tokenizer:
        """Loads the tokenizer and chat template of a GGUF file or of a Hugging
        Face checkpoint directory (``tokenizer.json`` + ``tokenizer_config.json``,
        the template in it or in ``chat_template.jinja``): seconds, blocking.
        Both give the same ids, template and EOS set for the same model
        (``tests/tokenizer/test_tokenizer_checkpoint_dir.py``).

        Args:
          model_path: the model's ``.gguf`` file or checkpoint directory.
          model: name reported in :attr:`info`; default: the file name up to
            its first dot (``SmolLM2-135M-Instruct.Q4_1.gguf`` gives
            ``SmolLM2-135M-Instruct``), or the directory's name.
          chat_template, chat_roles: as for the constructor.

        Raises:
          FileNotFoundError: no such file or directory; a directory without
            ``tokenizer.json`` or ``tokenizer.model``
            (:func:`~services.common.checkpoint.check_tokenizer_path`).
          ValueError / OSError: not a GGUF file; a config file that is not JSON;
            ``transformers`` cannot read a fast tokenizer from it; a bad chat role.
        """
        model_path = Path(model_path)
        check_tokenizer_path(model_path)
        hf = load_hf_tokenizer(model_path)
        if getattr(hf, "backend_tokenizer", None) is None:
            raise ValueError(f"{model_path}: transformers gave no fast tokenizer")
        if model_path.is_dir():
            extra = list(checkpoint_eos_ids(model_path)) if is_checkpoint_dir(model_path) else []
            name = model_path.name
        else:
            try:
                meta = read_gguf_scalars(model_path, _GGUF_EOS_KEYS)
            except GGUFFormatError:
                meta = {}
            extra = [int(v) for v in meta.values() if isinstance(v, int)]
            name = model_path.name.split(".")[0]
        return cls(hf, model or name, extra, chat_template=chat_template, chat_roles=chat_roles)

    @classmethod
    def from_definition(cls, definition: str, model: str, *, eos_token_ids: Sequence[int],
                        chat_template: str | None, special_tokens: Mapping[str, str],
                        chat_roles: Sequence[str] = DEFAULT_CHAT_ROLES) -> Tokenizer:
        """Rebuilds a loaded tokenizer from what :meth:`definition`,
        :attr:`chat_template`, :attr:`special_tokens` and :attr:`info` give
        (``GetTokenizer`` and ``GetTokenizerInfo`` carry them): the same ids,
        chat prompts and errors as the original for every input, since encode,
        decode and the template's markup run on the same ``tokenizers``
        definition and the template renders with the same special tokens
        (``tests/tokenizer/test_tokenizer_router_local.py``). Blocking: imports
        ``transformers`` (once) and parses the definition: 3.4 s for SmolLM2
        here at a load average of 12, most of it the import.

        Raises:
          ValueError: a definition ``tokenizers`` cannot read; a bad chat role.
        """
        import tokenizers
        from transformers import PreTrainedTokenizerFast

        try:
            backend = tokenizers.Tokenizer.from_str(definition)
        except Exception as err:  # tokenizers raises its own Exception subclass
            raise ValueError(f"tokenizer definition: {err}") from err
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)
        return cls(hf, model, eos_token_ids, chat_template=chat_template or None,
                   chat_roles=chat_roles)

    def _eos_ids(self, extra: Sequence[int]) -> tuple[int, ...]:
        ids = {int(i) for i in extra if 0 <= int(i) < self._vocab_size}
        if self._hf.eos_token_id is not None:
            ids.add(int(self._hf.eos_token_id))
        if self._template is not None:
            special = set(self._hf.all_special_tokens) | {
                t.content for t in self._hf.added_tokens_decoder.values() if t.special
            }
            for marker in _END_OF_TURN_MARKERS:
                if marker in self._template and marker in special:
                    ids.add(int(self._hf.convert_tokens_to_ids(marker)))
        return tuple(sorted(ids))

    @property
    def info(self) -> TokenizerInfo:
        """Vocabulary size, EOS/BOS ids, whether a chat template exists, its roles."""
        return self._info

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template in use (the configured one, else the
        model's), None without one."""
        return self._template

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens the chat template sees (``bos_token``,
        ``eos_token``, ...: ``transformers``' ``special_tokens_map``)."""
        return dict(self._hf.special_tokens_map)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped ``transformers`` tokenizer (read-only use)."""
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text in it (``<|im_start|>``)
        becomes the special token, as ``transformers`` and vLLM tokenize a raw
        prompt (``split_special_tokens=False``, the default).

        A text longer than :data:`DEFAULT_INLINE_ENCODE_MAX_CHARS` goes to
        the backend's ``encode_batch_fast`` (one text): the same ids as
        ``encode``, 25-40 % faster (no character offsets), and it releases the
        GIL while Rust works, so a worker thread encoding a long text does not
        stall the event loop. Here that is 70-90 µs for 100 tokens of English
        and 1.2 ms for 2,000 (a loaded 2-core machine). A shorter one (the
        texts encoded on an event loop) goes to ``encode``, which keeps the
        GIL: a release gives it to any other thread that waits for it, and
        the loop then waits up to the switch interval (5 ms) to get it back
        (measured: 2.7-5.3 ms a call beside one busy Python thread, against
        10-50 µs; 8.5 against 10 µs for a short prompt alone).

        Args:
          add_special_tokens: add BOS/EOS as the tokenizer's post-processor
            says (Gemma: BOS; SmolLM2: nothing).
        """
        if len(text) <= DEFAULT_INLINE_ENCODE_MAX_CHARS:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``, identical to ``transformers``' ``decode``
        (this model's tokenizer does no clean-up of spaces). Invalid UTF-8
        byte sequences come out as U+FFFD."""
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def definition(self) -> str:
        """The Rust ``tokenizers`` definition that :meth:`decode` runs, as its JSON
        serialization (``tokenizers.Tokenizer.from_str`` rebuilds it: the same
        :meth:`decode` text for every id sequence). 1.5 MB for SmolLM2, 14 MB
        for Gemma 3 (0.55 s to serialize here): call it once."""
        return self._backend.to_str()

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        """Raises :class:`InvalidTokenIdError` unless every id is in ``[0, vocab_size)``."""
        bad = first_out_of_range(token_ids, self._vocab_size)
        if bad is not None:
            raise InvalidTokenIdError(
                f"token_ids: {bad} is out of range [0, {self._vocab_size})"
            )

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    tools: Sequence[FunctionTool] = ()) -> str:
        """The chat template applied to ``messages``, as text.

        ``tools`` (none: the template's ``tools`` is undefined) and each
        message's ``tool_calls`` / ``tool_call_id`` go to the template as
        structured data, as transformers' ``apply_chat_template(messages,
        tools=...)`` and vLLM pass them (:func:`template_tools`,
        :func:`template_message`); a template without a tool section ignores them.

        Raises:
          NoChatTemplateError: the model has no chat template.
          ChatTemplateError: the template raised for this conversation; a
            call's arguments or a tool's parameters are not JSON.
        """
        self._require_template()
        conversation = [template_message(i, m) for i, m in enumerate(messages)]
        try:
            return self._hf.apply_chat_template(
                conversation, tools=template_tools(tools), chat_template=self._template,
                add_generation_prompt=add_generation_prompt, tokenize=False,
            )
        except Exception as err:  # jinja2 TemplateError, raise_exception() in templates
            raise ChatTemplateError(f"the chat template rejected the messages: {err}") from err

    def _require_template(self) -> None:
        if self._template is None:
            raise NoChatTemplateError(
                f"model {self._info.model!r} has no chat template (a base model?): "
                "send a raw prompt through Tokenize instead"
            )

    def _check_messages(self, messages: Sequence[ChatMessage]) -> None:
        """Raises ValueError / UnknownRoleError / NoChatTemplateError for a bad conversation."""
        if not messages:
            raise ValueError("messages: at least one message is required")
        for i, message in enumerate(messages):
            if not message.role:
                raise ValueError(f"messages[{i}].role is empty")
        self._require_template()
        for i, message in enumerate(messages):
            if message.role not in self._roles:
                allowed = ", ".join(f'"{r}"' for r in self._roles)
                raise UnknownRoleError(
                    f"messages[{i}].role: {message.role[:40]!r} is not a role of this model's "
                    f"chat template; use one of {allowed}")

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        max_prompt_tokens: int = 0,
        allow_special_tokens: bool = False,
        tools: Sequence[FunctionTool] = (),
    ) -> ChatPrompt:
        """Prompt token ids of a conversation, trimmed to a token budget.

        The ids equal ``transformers``' ``apply_chat_template(..., tokenize=True)``
        (the rendered text encoded without adding special tokens: the template
        writes them) whenever no message content holds special-token text.
        When one does, that text is tokenized as plain text, so only the
        template's markup makes control tokens (``transformers``'
        ``sanitize_control_tokens``), unless ``allow_special_tokens``.
        When the prompt exceeds ``max_prompt_tokens`` the oldest
        non-system messages are dropped, keeping every ``system`` message and
        the last message, with as few drops as fit. The smallest fitting drop
        count is found by binary search (the token count falls as messages are
        dropped): O(log n) renders for a long history, one for a prompt that fits.

        Args:
          messages: the conversation, oldest first; at least one.
          add_generation_prompt: append the assistant header so the model answers.
          max_prompt_tokens: token budget; 0 means no limit.
          allow_special_tokens: parse special-token text in contents into
            control tokens (only for trusted content: a message could then
            end its turn and forge another).
          tools: the template's ``tools`` (:meth:`render_chat`); like the
            messages' tool calls, the template writes them as markup.

        Raises:
          ValueError: ``messages`` is empty or a role is empty.
          UnknownRoleError: a role outside :attr:`TokenizerInfo.chat_roles` (INVALID_ARGUMENT).
          NoChatTemplateError: the model has no chat template (FAILED_PRECONDITION).
          ChatTemplateError: the template rejected the conversation or rewrites
            a content with special-token text; tools or tool calls hold such
            text (without ``allow_special_tokens``) or are not JSON (INVALID_ARGUMENT).
          PromptTooLongError: even the smallest prompt exceeds the budget (OUT_OF_RANGE).
        """
        self._check_messages(messages)
        if not allow_special_tokens:
            self._check_tool_texts(messages, tools)

        def render(num_dropped: int) -> list[int]:
            kept = _drop_oldest(messages, num_dropped)
            return self._encode_chat(kept, add_generation_prompt, allow_special_tokens, tools)

        ids = render(0)
        if max_prompt_tokens <= 0 or len(ids) <= max_prompt_tokens:
            return ChatPrompt(tuple(ids), 0)
        droppable = sum(1 for m in messages[:-1] if m.role != "system")
        if droppable == 0:
            raise PromptTooLongError(len(ids), max_prompt_tokens)
        smallest = render(droppable)
        if len(smallest) > max_prompt_tokens:
            raise PromptTooLongError(len(smallest), max_prompt_tokens)
        best, dropped = _fewest_drops(render, droppable, smallest, max_prompt_tokens)
        return ChatPrompt(tuple(best), dropped)

    def _check_tool_texts(self, messages: Sequence[ChatMessage],
                          tools: Sequence[FunctionTool]) -> None:
        """Raises ChatTemplateError when a tool or a tool call holds special-token
        text: the template writes them as markup, where it would become control
        tokens (fail closed, as for a content the template rewrites), or a
        tool's parameters are not JSON."""
        assert self._control is not None
        texts = [json.dumps(t, ensure_ascii=False) for t in template_tools(tools) or ()]
        texts += [f"{c.id}\n{c.name}\n{c.arguments_json}" for m in messages for c in m.tool_calls]
        texts += [m.tool_call_id for m in messages if m.tool_call_id]
        if texts and any(self._control.find(texts)):
            raise ChatTemplateError(
                "tools or tool calls hold special-token text, which this model's chat "
                "template would write as markup: remove it (or set allow_special_tokens "
                "if it is trusted)")

    def _encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                     allow_special_tokens: bool, tools: Sequence[FunctionTool] = ()) -> list[int]:
        """Ids of one rendering; content is text unless ``allow_special_tokens``."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        if allow_special_tokens:
            return self.encode(text)
        assert self._control is not None  # a template exists: render_chat checked
        contents = [m.content for m in messages]
        shape = tuple(dataclasses.replace(m, content="") for m in messages)
        starts = None
        for fresh in (False, True):  # a cached skeleton may be stale (a template that shows the date)
            skeleton = self._skeleton((shape, add_generation_prompt, tuple(tools)), fresh)
            starts = align(skeleton, contents, text) if skeleton is not None else None
            if starts is not None:
                break
        if starts is None:
            return self._encode_unaligned(contents, text)
        try:
            return encode_chat(text, skeleton, starts, self._control, self.encode)
        except ForgedControlTokenError as err:
            raise ChatTemplateError(str(err)) from err

    def _skeleton(self, key: _SkeletonKey, fresh: bool) -> Skeleton | None:
        """The template's markup for these messages without their contents
        (roles, tool calls), generation prompt and tools (cached), None when
        the template refuses placeholder contents."""
        shape, add_generation_prompt, tools = key
        cached = self._skeletons.get(key, _NOT_CACHED)
        if not fresh and cached is not _NOT_CACHED:
            return cached  # type: ignore[return-value]
        assert self._control is not None

        def render(contents: list[str]) -> str:
            return self.render_chat([dataclasses.replace(m, content=c)
                                     for m, c in zip(shape, contents)],
                                    add_generation_prompt, tools)
        try:
            skeleton: Skeleton | None = render_skeleton(render, len(shape), self._control)
        except ChatTemplateError:
            skeleton = None
        with self._skeletons_lock:  # oldest out first; readers only use .get
            if len(self._skeletons) >= _SKELETON_CACHE_SIZE:
                self._skeletons.pop(next(iter(self._skeletons)))
            self._skeletons[key] = skeleton
        return skeleton

    def _encode_unaligned(self, contents: Sequence[str], text: str) -> list[int]:
        """Ids when the template's output depends on the contents themselves
        (markup cannot be told apart): fine when no content holds
        control-token text, refused otherwise (fail closed)."""
        assert self._control is not None
        for i, spans in enumerate(self._control.find(contents)):
            if spans:
                start, end, _ = spans[0]
                raise ChatTemplateError(
                    f"messages[{i}].content holds the special-token text "
                    f"{contents[i][start:end]!r}, and this model's chat template rewrites "
                    "message content, so it cannot be kept as plain text: remove it (or set "
                    "allow_special_tokens if the content is trusted)")
        return self.encode(text)


def template_tools(tools: Sequence[FunctionTool]) -> list[dict[str, Any]] | None:
    """The chat template's ``tools``: OpenAI's tool objects (None without tools).

    Raises:
      ChatTemplateError: a tool's parameters are not JSON.
    """
    out = []
    for i, tool in enumerate(tools):
        try:
            out.append(tool.as_openai())
        except ValueError as err:
            raise ChatTemplateError(f"tools[{i}].parameters_json is not JSON: {err}") from err
    return out or None


def template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """One turn as the chat template sees it: ``role``, ``content``, and when
    set ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``, the arguments parsed from JSON as transformers' tool-use
    templates and vLLM expect) and ``tool_call_id``.

    Raises:
      ChatTemplateError: a call's arguments are not JSON.
    """
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.arguments_json)
            except ValueError as err:
                raise ChatTemplateError(
                    f"messages[{index}].tool_calls[{j}].arguments is not JSON: {err}") from err
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.name, "arguments": arguments}})
        turn["tool_calls"] = calls
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _fewest_drops(render: Callable[[int], list[int]], droppable: int, smallest: list[int],
                  budget: int) -> tuple[list[int], int]:
    """The prompt with the fewest oldest messages dropped that fits ``budget``
    tokens, and how many were dropped: a binary search over ``render(k)`` (the
    ids with ``k`` dropped), given that dropping none does not fit and
    dropping all ``droppable`` (``smallest``) does. A count the template
    refuses (e.g. roles must alternate) counts as not fitting."""
    # Invariant: render(lo) does not fit, render(hi) fits.
    lo, hi, best = 0, droppable, smallest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            candidate = render(mid)
        except ChatTemplateError:  # e.g. roles must alternate: drop more
            lo = mid
            continue
        if len(candidate) <= budget:
            hi, best = mid, candidate
        else:
            lo = mid
    return best, hi


def _drop_oldest(messages: Sequence[ChatMessage], count: int) -> list[ChatMessage]:
    """``messages`` without its ``count`` oldest non-system messages (the last one is never dropped)."""
    if count == 0:
        return list(messages)
    kept: list[ChatMessage] = []
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if count > 0 and i != last and message.role != "system":
            count -= 1
            continue
        kept.append(message)
    return kept
