"""The package's version: one place, read by the package root, the CLI, the server and the build (pyproject)."""

__version__ = "0.1.0"
