"""The cascade between two models of one mesh (issue 34, part 1).

A request to the cascade's alias model (``auto`` by default) is served by the
small model first; its first ``k`` tokens are held back while a confidence
rule computed from the small engine's own token logprobs decides: release
them and stream on, or cancel the small generation and serve the request
from the large model. A prompt-only rule and the request's mode (field
``cascade`` or header ``x-llmesh-cascade``) send a request straight to one
model. Modules:

* :mod:`.policy`: the policy's settings and the request's mode (typed, validated once);
* :mod:`.rule`: the confidence rule (a pure function of the logprobs);
* :mod:`.window`: the held-back window over a generation's events;
* :mod:`.path`: the path an answer took (what the edges report);
* :mod:`.runner`: the path decision and the two legs;
* :mod:`.flags`: the router's and ``llmesh up``'s flags;
* :mod:`.metrics`: ``llmesh:cascade_*``.

This package's ``__init__`` imports nothing: :mod:`services.router.generation`
imports :mod:`.path`, and :mod:`.runner` imports the pipeline's types.
"""
