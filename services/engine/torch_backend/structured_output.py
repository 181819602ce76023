"""Compiling a request's output constraint into an llguidance matcher, bounded in time.

A :class:`~services.common.sampling.StructuredOutput` (JSON schema, any JSON
object, regex, Lark or GBNF grammar, choice) becomes an llguidance grammar
(``llguidance.grammar_from``; formats as in llguidance's docs,
https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md and
``docs/json_schema.md``), which an ``llguidance.LLMatcher`` compiles against the
served model's vocabulary. The vocabulary comes from the same GGUF the engine
loads: ``transformers`` reads the tokenizer from it (as the tokenizer service
does, :mod:`services.tokenizer.tokenizer`) and ``llguidance.hf.from_tokenizer``
wraps its Rust ``tokenizers`` JSON (llguidance's README, "Python bindings").
That takes seconds, so it happens once per process and model file, at the
first constrained request, outside the compile bound.

Compilation (the matcher's construction plus its first mask, where llguidance
builds its lexer lazily) runs on a small thread pool, never on the step
thread or the event loop (llguidance drops the GIL while it works). A request
waits at most ``timeout_s`` for it; past that it is refused with
INVALID_ARGUMENT naming the limit (vLLM has no such bound: vLLM issue #54003).
A compile that overruns keeps its worker until it ends (a thread cannot be
stopped), bounded by llguidance's own resource limits (``LLParserLimits``);
its result is then cached, so a retry may succeed. While every worker is busy
with slow grammars, new constraints wait in the pool's queue and that wait
counts against their bound too; requests without a constraint never wait.

Compiled grammars are cached by the SHA-256 of the constraint (bounded LRU of
:data:`DEFAULT_CACHE_SIZE`); each request gets its own matcher, a
``deep_copy`` of the cached one (its state only; the compiled grammar is
shared). Errors (an invalid constraint) are cached as well: the same text
always gets the same answer. Requests for a grammar being compiled wait on
that one compile.

Status codes (as :class:`~services.common.sampling.InvalidRequestError`):

* INVALID_ARGUMENT ``sampling.structured_output.<kind>``: llguidance refused
  it (its message), or it took longer than the bound (the limit and the flag).
* FAILED_PRECONDITION ``sampling.structured_output``: the model's tokenizer
  could not be read from its GGUF.

Threading: :meth:`GrammarCompiler.compile` is a coroutine for the engine's
event loop(s); the cache is guarded by a lock; matchers it returns belong to
one sequence each (the engine thread uses them afterwards).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import llguidance

from services.common.checkpoint import load_hf_tokenizer
from services.common.sampling import (
    JSON_COMPILE_OPTIONS,
    ConstraintKind,
    InvalidRequestError,
    StructuredOutput,
)
from services.engine.torch_backend.grammar_mask import GrammarMatcher

#: Compiled grammars kept per engine.
DEFAULT_CACHE_SIZE = 64
#: Compile threads per engine (each may be held by a slow grammar).
DEFAULT_COMPILE_WORKERS = 2
#: The longest llguidance error message passed on to the client.
MAX_ERROR_CHARS = 600
#: JSON layout the model must write: compact separators and no free whitespace
#: (llguidance's JsonCompileOptions; a small model left free whitespace may
#: spend its token budget on it).
JSON_OPTIONS = JSON_COMPILE_OPTIONS
FIELD = "sampling.structured_output"

_tokenizers: dict[tuple[str, int, tuple[int, ...]], llguidance.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def load_tokenizer(gguf_path: Path, vocab_size: int,
                   eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of the model in ``gguf_path`` (seconds the first
    time, then cached per process).

    Args:
      gguf_path: the model's GGUF file or checkpoint directory (its tokenizer
        is read by ``transformers``, :func:`~services.common.checkpoint.load_hf_tokenizer`).
      vocab_size: rows of the model's logits; the mask has one bit per id below it.
      eos_token_ids: ids the grammar allows once it accepts (the model's EOS set).

    Raises:
      ValueError / OSError: ``transformers`` cannot read a fast tokenizer from it.
    """
    key = (str(gguf_path), vocab_size, tuple(sorted(eos_token_ids)))
    with _tokenizers_lock:
        if key not in _tokenizers:
            from llguidance.hf import from_tokenizer  # imports transformers

            hf = load_hf_tokenizer(gguf_path)
            _tokenizers[key] = from_tokenizer(hf, n_vocab=vocab_size,
                                              eos_token=list(key[2]) or None)
        return _tokenizers[key]


def grammar_text(constraint: StructuredOutput) -> str:
    """The llguidance grammar of ``constraint`` (``llguidance.grammar_from``).

    Raises:
      ValueError: a GBNF grammar that does not convert to Lark, or a schema
        that is not a JSON object (llguidance's message).
    """
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.spec,
                                                             defaults=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return llguidance.grammar_from("regex", constraint.spec)
    if kind is ConstraintKind.GRAMMAR:  # Lark, or GBNF (``::=``) converted to Lark
        return llguidance.grammar_from("gbnf" if "::=" in constraint.spec else "lark",
                                       constraint.spec)
    return llguidance.grammar_from("choice", json.dumps(list(constraint.choices)))


def constraint_key(constraint: StructuredOutput) -> str:
    """SHA-256 hex of the constraint (its kind, text and choices)."""
    digest = hashlib.sha256(constraint.kind.value.encode())
    digest.update(b"\0" + constraint.spec.encode())
    digest.update(b"\0" + json.dumps(list(constraint.choices)).encode())
    return digest.hexdigest()


class GrammarCompiler:
    """Compiles constraints for one model, off the event loop, within a time bound.

    Args:
      gguf_path: the served model's GGUF (source of the vocabulary).
      vocab_size: the model's logit rows.
      eos_token_ids: the model's EOS ids.
      timeout_s: most seconds a request waits for its grammar (> 0).
      cache_size: compiled grammars kept (LRU).
      workers: compile threads.

    Raises:
      ValueError: ``timeout_s`` <= 0 or ``cache_size`` < 1.
    """

    def __init__(self, gguf_path: Path, vocab_size: int, eos_token_ids: Sequence[int],
                 timeout_s: float, cache_size: int = DEFAULT_CACHE_SIZE,
                 workers: int = DEFAULT_COMPILE_WORKERS) -> None:
        if timeout_s <= 0 or cache_size < 1:
            raise ValueError(f"need timeout_s > 0 and cache_size >= 1, got {timeout_s}, "
                             f"{cache_size}")
        self._gguf_path = gguf_path
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, Future[llguidance.LLMatcher]] = (
            collections.OrderedDict())
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        #: compiles started (cache misses) so far
        self.num_compiles = 0

    async def compile(self, constraint: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher of ``constraint`` for one sequence.

        Raises:
          InvalidRequestError: see the module docstring's status codes.
        """
        tokenizer = await self._load_tokenizer()
        compiled = self._compiled(constraint, tokenizer)
        field = f"{FIELD}.{constraint.kind.value}"
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
            # cancel that lands as the compile ends (the request would go on)
            async with asyncio.timeout(self.timeout_s):
                template = await asyncio.shield(asyncio.wrap_future(compiled))
        except TimeoutError:
            raise InvalidRequestError(
                field, f"did not compile within the engine's limit of {self.timeout_s:g} s "
                "(--structured-output-compile-timeout-s); simplify the constraint") from None
        except ValueError as err:
            raise InvalidRequestError(field, _clip(str(err))) from None
        return GrammarMatcher(template.deep_copy(), self._vocab_size)

    def shutdown(self) -> None:
        """Stops taking compiles; running ones finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _load_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(load_tokenizer, self._gguf_path,
                                                    self._vocab_size, self._eos)
            loading = self._tokenizer
        try:
            return await asyncio.shield(asyncio.wrap_future(loading))
        except (OSError, ValueError) as err:
            with self._lock:
                if self._tokenizer is loading:
                    self._tokenizer = None  # the next request tries again
            raise InvalidRequestError(
                FIELD, f"the engine could not read its model's tokenizer from "
                f"{self._gguf_path.name}: {err}", grpc.StatusCode.FAILED_PRECONDITION) from None

    def _compiled(self, constraint: StructuredOutput,
                  tokenizer: llguidance.LLTokenizer) -> Future[llguidance.LLMatcher]:
        """The cached (or now started) compile of ``constraint``."""
        key = constraint_key(constraint)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
            started = self._pool.submit(_build_matcher, constraint, tokenizer)
            self.num_compiles += 1
            self._cache[key] = started
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return started


def _build_matcher(constraint: StructuredOutput,
                   tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """Compiles ``constraint`` (on a pool thread) and computes its first mask.

    Raises:
      ValueError: llguidance's error message.
    """
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()  # llguidance builds its lexer lazily: pay for it here
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


def _clip(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " …"
