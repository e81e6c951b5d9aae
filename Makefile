# The two commands of the README. Both install what they need first: .venv (scripts/setup.sh), and for
# the tests also .venv-vllm (scripts/setup-vllm.sh: vLLM's CPU build pins a transformers older than
# .venv's), where the vLLM connector's tests run; in .venv they skip.
.PHONY: setup demo test bench-docs

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/rag-kvcache demo

# The suite runs twice: in file order, then in one fixed shuffled order (pytest-randomly, seed TEST_SEED), so that a
# test depending on another's state (an engine, a cache, a module global left behind) fails here, reproducibly:
# `.venv/bin/python -m pytest -p randomly --randomly-seed=$(TEST_SEED)` repeats the order.
TEST_SEED ?= 4242
test: setup
	.venv/bin/ruff format --check rag_kvcache integrations tests benchmarks datasets  # the layout ruff format gives (pyproject)
	.venv/bin/ruff check rag_kvcache integrations tests benchmarks datasets  # pyflakes, errors, import order (pyproject)
	.venv/bin/mypy  # the package's types, at the strictness of pyproject's [tool.mypy]
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site  # the docs site: a broken link fails
	.venv/bin/python -m pip wheel -q --no-deps -w dist . integrations/langchain integrations/llamaindex  # the three pip packages
	.venv/bin/python -m pytest -q -p no:randomly  # in file order
	.venv/bin/python -m pytest -q -p randomly -p no:cacheprovider --randomly-seed=$(TEST_SEED)  # one fixed shuffled order
	bash scripts/setup-vllm.sh
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_vllm_connector.py tests/integration/test_vllm_prefix_cache.py tests/integration/test_vllm_remote.py

# The CPU tables docs/benchmarks.md quotes, re-run at a reduced size (about 40-60 minutes on 2 cores; results under
# bench-docs/): the methods on MuSiQue (10 questions, not 50), the default against CacheBlend (10, not 40), the
# planted facts left where retrieval ranks them (20, not 40), and the conversation cache (as published). Not here:
# the GPU table (benchmarks/gpu/run.sh, on a device) and the vLLM connector's (benchmarks/vllm/, in .venv-vllm).
# MUSIQUE: the MuSiQue dev set in CacheBlend's layout (datasets/musique.md).
MUSIQUE ?= ../shared/data/musique_dev.json
BENCH_DOCS ?= bench-docs
bench-docs: setup
	.venv/bin/rag-kvcache bench --dataset $(MUSIQUE) --limit 10 --chunk-prefill behind_prefix \
		--methods full,reuse,cacheblend,epic:k=16,cacheblend_repick --out $(BENCH_DOCS)/methods
	.venv/bin/rag-kvcache bench --dataset $(MUSIQUE) --limit 10 --chunk-tokens 512 \
		--methods full,cacheblend@behind_prefix,epic_match --baseline cacheblend@behind_prefix --chunk-order best_last \
		--out $(BENCH_DOCS)/default
	.venv/bin/rag-kvcache bench --dataset planted:$(MUSIQUE) --limit 20 --chunk-tokens 512 --methods full,epic_match \
		--baseline epic_match --evidence retrieved --chunk-order best_last --out $(BENCH_DOCS)/planted
	.venv/bin/python benchmarks/chat/conversation.py --index $(BENCH_DOCS)/chat-idx --out $(BENCH_DOCS)/conversation.json
