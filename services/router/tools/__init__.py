"""Tool calling (OpenAI's ``tools``) behind both edges.

* :mod:`.hermes`: the one tool format the mesh renders and constrains
  (Hermes: ``<tools>`` in the system turn, ``<tool_call>`` calls,
  ``<tool_response>`` results);
* :mod:`.grammar`: the llguidance Lark grammar that makes calls valid by
  construction;
* :mod:`.validate`: ``Chat.tools`` / ``tool_choice`` checked at the router's
  edge (schemas compiled, names resolved): nothing invalid reaches an engine;
* :mod:`.parser`: the incremental state machine that turns generated text into
  content and :class:`~services.common.wire.tools.ToolCallDelta` pieces;
* :mod:`.stream`: that parser applied to a request's event stream.
"""
