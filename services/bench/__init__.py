"""``llmesh bench``: a serving benchmark in the manner of ``vllm bench serve``.

It measures llmesh over gRPC (through Envoy or straight to the router) and any
OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``)
with the same prompts, load shapes and figures:

- :mod:`services.bench.datasets`  random / shared-prefix / conversations prompts
- :mod:`services.bench.backends`  one async streaming client per target
- :mod:`services.bench.load`      Poisson/gamma arrivals, max concurrency, warm-up, bounds
- :mod:`services.bench.metrics`   pure functions: per-request records → result figures
- :mod:`services.bench.report`    terminal table, JSON, PNG
- :mod:`services.bench.main`      the command line (``llmesh bench``, ``python -m services.bench``)

Usage and flag reference: ``docs/bench.md``.
"""
