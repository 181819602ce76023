"""The ``template`` tool format on the real SmolLM2 mesh: the tokenizer serves
SmolLM2 with a ChatML template that has a Qwen2.5-style tool section
(``--chat-template tests/fixtures/chatml_tools.jinja``), so the router's
``auto`` format is ``template``: tools, calls and results are written by the
template, calls are constrained in the Hermes syntax it teaches.

Cost: a module mesh of its own (one engine, 1,024-token window, no Redis):
about 10 s to start here (load average ~2) plus three short greedy generations.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from services.cli.mesh import Mesh
from tests.e2e.test_mesh_models import post
from tests.e2e.test_mesh_tools import WEATHER_SCHEMA, run_tool_loop
from tests.tokenizer.test_tokenizer_router_local import TOOL_LOOP_TEXT
from tests.tokenizer.tokenizer_helpers import TOOLS_TEMPLATE

pytestmark = pytest.mark.mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """SmolLM2 served with the tool template (overrides the session mesh here,
    so that the shared ``client`` and ``model`` fixtures use it)."""
    run_dir: Path = tmp_path_factory.mktemp("tool-template-mesh")
    with Mesh(ingress_port=0, admin_port=0, run_dir=run_dir,
              tokenizer_args=["--chat-template", str(TOOLS_TEMPLATE)],
              engine_args=["--max-model-len", "1024", "--kv-cache-bytes", str(64 << 20)]
              ) as mesh:
        yield mesh


def test_tokenize_renders_tools_and_a_call_loop_through_the_template(mesh: Mesh) -> None:
    """``/tokenize`` with ``tools`` gives a generation's prompt: the template's
    own tool section (its default system line, then ``# Tools``), not the
    Hermes system turn the router would write."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'}]
    tokens = post(mesh, "/tokenize", {"messages": messages, "tools": tools})["tokens"]
    assert post(mesh, "/detokenize", {"tokens": tokens})["prompt"] == TOOL_LOOP_TEXT


def test_required_call_validates_and_the_loop_answers_in_text(
        client: openai.OpenAI, model: str) -> None:
    """The shared e2e ``client`` and ``model`` fixtures, on this module's mesh."""
    first, _ = run_tool_loop(client, model, parallel_tool_calls=False, max_tokens=64)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
