"""Tool calling (OpenAI's ``tools``) behind both edges.

* :mod:`.formats`: the tool format per model (``template``: the chat
  template's own tool section renders tools, calls and results; ``hermes``:
  the router writes them as plain messages);
* :mod:`.hermes`: the Hermes format (``<tools>`` in the system turn,
  ``<tool_call>`` calls, ``<tool_response>`` results), and the call syntax
  both formats constrain and parse;
* :mod:`.grammar`: the llguidance Lark grammar that makes calls valid by
  construction;
* :mod:`.validate`: ``Chat.tools`` / ``tool_choice`` checked at the router's
  edge (schemas compiled, names resolved): nothing invalid reaches an engine;
* :mod:`.parser`: the incremental state machine that turns generated text into
  content and :class:`~services.common.wire.tools.ToolCallDelta` pieces;
* :mod:`.stream`: that parser applied to a request's event stream.
"""
