"""Retrieval-augmented generation in the router (issue 35, the router side).

A request with ``retrieval`` (``GenerateRequest.retrieval``, the OpenAI chat
body's ``retrieval`` extension) makes the router query the retriever
(``llmesh.v1.RetrieverService.Query``) with its last user turn as soon as the
request is validated, beside the rest of its preparation, and insert the
passages as one user message just before that turn (docs/architecture.md
"Retrieval"). The parts, one job each:

* :mod:`.spec`: the request's retrieval, validated at the edge;
* :mod:`.client`: the retriever's gRPC client (Query, Embed);
* :mod:`.placement`: the passages message and where it goes;
* :mod:`.stage`: the query started early, awaited where the passages are
  needed, with the failure policy, metrics, trace span and log fields;
* :mod:`.report`: what the response says about it (chunks used, latency);
* :mod:`.embeddings`: ``POST /v1/embeddings`` in OpenAI's shape.
"""
