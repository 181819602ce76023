"""``llmesh`` command line, mesh launcher and Envoy bootstrap builder."""
