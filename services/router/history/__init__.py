"""Chat history that is summarised, not just dropped (``--history-budget-tokens``).

When a chat's prompt nears its model's history budget, the router writes a
summary of the oldest turns in the background, through the mesh's own engines
at batch priority (a turn past the budget meanwhile is served trimmed, the
oldest turns dropped, as without a budget); the summary is stored in the cache service, keyed by the
tenant's cache scope and a hash of the messages it replaces, so the next turn
of the same conversation, on any router, starts with the system turn and the
summary: a prompt prefix that stays the same until the next compaction, which
the engines' prefix cache and KV-aware routing reuse.

The pieces, each with one job:

* :mod:`.settings`: the flags (budget per model, summariser model, summary
  length) as typed values;
* :mod:`.conversation`: a conversation split into system turns and the rest,
  its chained prefix hashes, and the prompt rewrite (the summary in the system
  turn);
* :mod:`.plan`: which turns a compaction summarises;
* :mod:`.store`: the cache service's summary RPCs as typed calls;
* :mod:`.summarizer`: the summarisation request (prompt, greedy sampling);
* :mod:`.compactor`: the pipeline's hook that ties them together;
* :mod:`.metrics`: what it counts.
"""
