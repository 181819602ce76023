"""tools/engine_path.py: a token's forms are counted from the engine core to
the client, through a real router (issue 32's count), not only to the
engine's wire."""

from __future__ import annotations

from tools import engine_path


def test_counts_the_forms_of_a_token_from_the_engine_core_to_the_client() -> None:
    path = engine_path.measure(streams=2)
    assert path.forms[-1] == "llmesh.v1.SequenceUpdate"  # the engine's wire message
    assert path.router_forms[0] == "llmesh.v1.SequenceUpdate"  # ... read by the router
    assert path.router_forms[-1] == "llmesh.v1.GenerateResponse"
    # The wire message counted once; a type the router decodes into again counts again.
    assert path.client_forms == path.forms + path.router_forms[1:]
    # The engine core's delta is the wire's type, sent and read back as itself
    # (issue 32: 7 forms before; the router's pipeline event is the one left
    # above the target of 4).
    assert path.forms == ("services.common.wire.engine_stream.TokenDelta",
                          "llmesh.v1.SequenceUpdate")
    assert len(path.client_forms) <= 5
    report = engine_path.report(path)
    assert report[0].startswith(f"{len(path.client_forms)} forms of a token, engine core to "
                                "client: ")
    assert path.tasks_per_stream == 0 and path.queues_per_stream == 0
