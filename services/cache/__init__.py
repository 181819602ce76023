"""The cache service: a response cache for deterministic requests.

``keys`` builds the store key of a request, ``store`` holds bytes (embedded
in-memory LRU or Redis), ``service`` serves ``llmesh.v1.CacheService`` and
``__main__`` runs it (``python -m services.cache``).
"""
