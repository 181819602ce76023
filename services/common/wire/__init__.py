"""Each hop's messages, defined once and imported by both ends.

Every module holds the typed frozen dataclasses of one message family, with
their ``from_pb`` (protobuf in, at the edge that receives it) and ``to_pb``
(protobuf out, at the edge that sends it); nothing past the edges handles
protobuf. Validation stays once, at the receiving edge: ``from_pb`` here only
converts, except where its docstring says it checks.

* :mod:`.chat`: chat messages and the prompt a chat template makes (router ↔
  tokenizer).
* :mod:`.tokenizer_info`: facts about a tokenizer (tokenizer → router).
* :mod:`.engine_info`: a replica's model and limits, and its load (engine →
  router).
* :mod:`.cache`: response-cache keys and cached responses (router ↔ cache).
* :mod:`.engine_stream`: the engine's multiplexed stream: starts, cancels and
  token updates with the one function that merges them (router ↔ engine,
  carried by the stream kit :mod:`services.common.mux`).

Sampling options (``SamplingParams``, ``SpeculativeParams``, priority, finish
reason) are the wire types of every hop and live in
:mod:`services.common.sampling`, whose ``from_pb`` validates them.
"""
