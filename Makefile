# The two commands of the README. Both install what they need first: .venv (scripts/setup.sh), and for
# the tests also .venv-vllm (scripts/setup-vllm.sh: vLLM's CPU build pins a transformers older than
# .venv's), where the vLLM connector's tests run; in .venv they skip.
.PHONY: setup demo test

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/rag-kvcache demo

test: setup
	.venv/bin/ruff format --check rag_kvcache integrations tests benchmarks datasets  # the layout ruff format gives (pyproject)
	.venv/bin/ruff check rag_kvcache integrations tests benchmarks datasets  # pyflakes, errors, import order (pyproject)
	.venv/bin/mypy  # the package's types, at the strictness of pyproject's [tool.mypy]
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site  # the docs site: a broken link fails
	.venv/bin/python -m pip wheel -q --no-deps -w dist . integrations/langchain integrations/llamaindex  # the three pip packages
	.venv/bin/python -m pytest -q
	bash scripts/setup-vllm.sh
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_connector.py tests/test_vllm_prefix_cache.py tests/test_vllm_remote.py
