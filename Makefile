# The two commands of the README. Both install what they need into .venv first.
.PHONY: setup demo test

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/rag-kvcache demo

test: setup
	.venv/bin/python -m pytest -q
