"""The documentation: every code block runs or says it is a fragment; the site builds strictly.

Pages are ``README.md`` and ``docs/**/*.md``. A fenced block preceded by an HTML comment
(invisible on the page) is marked:

* ``<!-- fragment: why -->``: not a program (a shell command, output, a sketch that names a
  reader's own functions). Every block that is not Python must be marked so;
* ``<!-- needs: redis, postgres, kafka -->``: a program that runs against a server, reading
  its address from ``RXCOORD_REDIS_URL``, ``RXCOORD_POSTGRES_URL`` or
  ``RXCOORD_KAFKA_BOOTSTRAP`` (here: the suite's throwaway servers and broker).

Every other Python block is a program that runs as written, in a fresh interpreter in an empty
directory, and must exit 0. A line ``--8<-- "path"`` (the snippets extension) stands for that
file of the repository, as on the built page.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
PYTHON = ("python", "py", "python3")
# What a `needs:` marker may name: the environment variable the block reads, and the fixture
# that provides it.
SERVERS = {
    "redis": ("RXCOORD_REDIS_URL", "redis_url"),
    "postgres": ("RXCOORD_POSTGRES_URL", "postgres_url"),
    "kafka": ("RXCOORD_KAFKA_BOOTSTRAP", "kafka_bootstrap"),
}

_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>fragment|needs)\s*:?\s*(?P<what>.*?)\s*-->\s*$")
_INCLUDE = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # 1-based, the opening fence
    language: str
    code: str
    marker: str  # "fragment", "needs" or ""
    what: str  # the marker's text after the colon

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.language in PYTHON and self.marker != "fragment"

    @property
    def needs(self) -> tuple[str, ...]:
        if self.marker != "needs":
            return ()
        return tuple(part.strip() for part in self.what.split(",") if part.strip())


def _included(code: str) -> str:
    """The block as the built page shows it: ``--8<-- "path"`` lines replaced by the file."""
    lines = []
    for line in code.splitlines():
        include = _INCLUDE.match(line)
        lines.append(
            (ROOT / include["path"]).read_text(encoding="utf-8").rstrip("\n") if include else line
        )
    return "\n".join(lines) + "\n"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the marker right above each (blank lines between
    the marker and the fence are allowed)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^[ ]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        assert end < len(lines), f"{page}:{i + 1}: a code block that is never closed"
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        above = i - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = _MARKER.match(lines[above]) if above >= 0 else None
        found.append(
            Block(
                page,
                i + 1,
                opening["info"].lower(),
                _included("\n".join(body)),
                marker["kind"] if marker else "",
                marker["what"] if marker else "",
            )
        )
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]
RUNNABLE = [block for block in ALL if block.runnable]


def test_the_pages_have_programs() -> None:
    # The extraction itself: a parser that found nothing would pass everything below.
    assert len(PAGES) >= 12, PAGES
    assert len(RUNNABLE) >= 20, [b.where for b in RUNNABLE]
    assert {b.page.name for b in RUNNABLE} >= {"README.md", "getting-started.md", "leases.md"}


def test_every_block_runs_or_is_marked_a_fragment() -> None:
    unmarked = [
        f"{b.where} ({b.language or 'no language'})"
        for b in ALL
        if b.language not in PYTHON and b.marker != "fragment"
    ]
    assert not unmarked, (
        "blocks that are not Python programs must be marked <!-- fragment: why --> above "
        f"their fence: {unmarked}"
    )
    unknown = [f"{b.where}: {need}" for b in ALL for need in b.needs if need not in SERVERS]
    assert not unknown, f"needs: names one of {sorted(SERVERS)}: {unknown}"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_the_block_runs_as_written(
    block: Block, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("RXCOORD_") or key == "RXCOORD_REQUIRE_BACKENDS"
    }
    for need in block.needs:
        variable, fixture = SERVERS[need]
        env[variable] = str(request.getfixturevalue(fixture))
    program = tmp_path / "snippet.py"
    program.write_text(block.code, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(program)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout}\n{proc.stderr}"
    # Quietly, too: an error a subscriber did not handle, a warning, a lease left to expire
    # would be logged there.
    assert not proc.stderr, f"{block.where} wrote to stderr:\n{proc.stderr}"


# -- the README is the front page ----------------------------------------------------------------


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for command in ("make demo", "make test"):
        assert command in readme
    first = next(b for b in blocks(ROOT / "README.md") if b.runnable)
    example = (ROOT / "examples" / "first_program.py").read_text(encoding="utf-8")
    assert first.code == example, "the README's first program is examples/first_program.py"
    assert len([line for line in example.splitlines() if line.strip()]) <= 20
    assert "docs/index.md" in readme  # the way to the rest


def test_getting_started_lists_every_example() -> None:
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "examples").glob("*.py")) if p.name not in page]
    assert not missing, f"examples the getting-started page does not list: {missing}"


def test_the_readme_says_why_each_dependency_is_there() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Why each dependency is there", 1)[1].split("\n## ", 1)[0]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra, listed in project["optional-dependencies"].items():
        assert f"`{extra}`" in section, f"the extra {extra!r} is not explained"
        requirements += [r for r in listed if not r.startswith("rxcoord[")]
    for requirement in requirements:
        name = re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0]
        assert name in section, f"{name} is not explained in the README's dependency section"


# -- the site ------------------------------------------------------------------------------------


def test_the_api_reference_covers_every_public_name() -> None:
    # Every name a public module exports has a `::: dotted.name` of its own (a name that
    # rxcoord.leases re-exports from rxcoord counts once, as the same object).
    documented = []
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("::: "):
                module, _, name = line[4:].strip().rpartition(".")
                documented.append(getattr(importlib.import_module(module), name))
    missing = [
        f"{module}.{name}"
        for module in ("rxcoord", "rxcoord.leases", "rxcoord.kafka", "rxcoord.operators")
        for name in importlib.import_module(module).__all__
        if name != "__version__"
        and not any(getattr(importlib.import_module(module), name) is d for d in documented)
    ]
    assert not missing, f"public names without an API reference entry: {missing}"


@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    # --strict turns every warning into a failure: a broken link or anchor, a page left out
    # of the navigation, an API reference that names a missing object.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # the theme's banner about its future
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr
    site = tmp_path / "site"
    assert (site / "img" / "bench-throughput.svg").read_bytes().startswith(b"<?xml")
    assert (site / "img" / "bench-light-tenant.svg").is_file()
    performance = (site / "performance" / "index.html").read_text(encoding="utf-8")
    assert "<!-- bench: table -->" not in performance  # the table was drawn in
    reference = (site / "reference" / "leases" / "index.html").read_text(encoding="utf-8")
    assert "LeaseReleasedError" in reference  # the Raises: sections, rendered
    assert "fonts.googleapis.com" not in (site / "index.html").read_text(encoding="utf-8")
