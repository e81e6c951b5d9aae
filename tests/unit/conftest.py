# Unit tests: pure functions, and the engine on the tiny random-weight Llama (`tiny`, `bpe_tiny`) with the real
# MiniLM tokenizer and embedder; in-process only (the CLI through Typer's CliRunner). Seconds each, on CPU.
# Fixtures and helpers: ../conftest.py, ../tiny_model.py, ../synthetic.py (on sys.path: pyproject's `pythonpath`).
