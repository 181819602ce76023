"""Each hop's messages, defined once and imported by both ends, with their
``from_pb``/``to_pb`` (mini-sglang's ``message/`` package, TGI's one
conversion at the edge)."""
