"""The package, the integrations' source, the README and docs/ state what is: no "session <number>" (the
development log lives in benchmarks/RESULTS.md and git) and no absolute path of a build machine (its temporary
folder, its workspace, a home folder), which no user's machine has. No package module is over 450 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:tmp|work|home)/[\w.$~-]")  # a path's start, not a URL's tail
TEXT = {".py", ".md", ".txt", ".json", ".toml", ".yaml", ".yml", ".html", ".j2", ".cfg", ".ini"}


def text_files(folder: Path, skip_tests: bool = False) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix in TEXT
        and "__pycache__" not in p.parts
        and not (skip_tests and ("tests" in p.relative_to(folder).parts or p.name == "conftest.py"))
    )


def offences(path: Path) -> list[str]:
    """Each line of `path` that names a session or a build machine's path, as `file:line: match`."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        for pattern in (SESSION, MACHINE_PATH):
            if match := pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    return found


def source_params() -> list:
    files = text_files(ROOT / "rag_kvcache") + text_files(ROOT / "integrations", skip_tests=True)
    return [pytest.param(path, id=path.relative_to(ROOT).as_posix()) for path in files]


@pytest.mark.parametrize("path", source_params())
def test_source_names_no_session_and_no_machine_path(path: Path) -> None:
    assert offences(path) == []


def test_readme_and_docs_name_no_session_and_no_machine_path() -> None:
    found = [hit for path in [ROOT / "README.md", *text_files(ROOT / "docs")] for hit in offences(path)]
    assert found == []


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("measured in session 47", True),
        ("Sessions 33-34", True),
        ("see /tmp/bench.lock", True),
        ("reads ../shared/x and /work/shared/data/musique_dev.json", True),
        ("`/home/user/notes`", True),
        ("a session's cache", False),
        ("https://example.org/home/page", False),
        ("relative tmp/x and ~/work/x", False),
    ],
)
def test_the_patterns_catch_what_they_mean_to(line: str, flagged: bool) -> None:
    assert bool(SESSION.search(line) or MACHINE_PATH.search(line)) == flagged


MAX_MODULE_LINES = 450  # a module over this holds more than one idea: split it by job


def test_no_package_module_is_over_the_line_limit() -> None:
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in sorted((ROOT / "rag_kvcache").rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
