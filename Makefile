# llmesh developer targets. Generated code is only ever written by `make generate`.
PYTHON ?= python
DESCRIPTOR := envoy/llmesh_descriptor.binpb

.PHONY: generate lint breaking check-generated envoy-config test up

## Regenerates the Python stubs (services/gen) and Envoy's descriptor set from proto/.
generate:
	buf generate --path proto/llmesh
	buf build --path proto/llmesh --exclude-source-info -o $(DESCRIPTOR)

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

test:
	$(PYTHON) -m pytest -q

up:
	llmesh up
