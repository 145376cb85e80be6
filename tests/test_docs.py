"""The README and the docs/ pages hold together: every relative link points to a file that exists (and to
a heading of it, when it names an anchor), docs/tests.md names every test file, and .ci/run still finds
the test commands in README.md."""

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text outside code blocks and inline code, where a `[x](y)` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed,
    spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):  # a heading's inline code counts
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_pages_exist_and_the_readme_links_every_docs_page():
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert len(docs) >= 10
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    assert [p.name for p in docs if p.resolve() not in linked] == []


def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert broken == []


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Its part\n\n[ok](#its-part) [x](b.md) `[no](c.md)`\n")
    (tmp_path / "b.md").write_text("[ok](a.md#its-part) [bad](a.md#nothing) [gone](c.md)\n")
    assert anchors(tmp_path / "a.md") == {"a-page", "its-part"}
    assert relative_links(tmp_path / "a.md") == ["#its-part", "b.md"]
    assert relative_links(tmp_path / "b.md") == ["a.md#its-part", "a.md#nothing", "c.md"]
    assert slug("Reading `rq info`") == "reading-rq-info"
    assert slug("Long runs: streamed, past the context window, watched live") == (
        "long-runs-streamed-past-the-context-window-watched-live"
    )


def test_ci_reads_the_test_commands_from_the_readme():
    """.ci/run takes the second line after each of the two markers (awk) and runs it verbatim: the test
    command, then the kill tests'; between them they select every test."""
    script = (ROOT / ".ci" / "run").read_text()
    awk = script.split('command=$(awk "', 1)[1].split('"', 1)[0]
    assert "for marker in test-command kill-test-command" in script
    lines = []
    for marker in ("test-command", "kill-test-command"):
        program = awk.replace("$marker", marker)
        done = subprocess.run(["awk", program, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
        lines.append(done.stdout.strip())
    assert lines == [
        "pip install -e '.[test]' && python -m pytest -m \"not crash and not chaos and not failover and not bench\"",
        'python -m pytest -m "crash or chaos or failover or bench"',
    ]
    # A marker added to pyproject.toml but to neither command would leave its tests out of both, or in both.
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = [line.split(":", 1)[0] for line in ini["markers"]]
    assert lines[0].endswith('"' + " and ".join(f"not {m}" for m in markers) + '"'), (markers, lines[0])
    assert lines[1].endswith('"' + " or ".join(markers) + '"'), (markers, lines[1])


def test_the_tests_page_names_every_test_file():
    page = (ROOT / "docs" / "tests.md").read_text()
    unnamed = [f.name for f in sorted((ROOT / "tests").glob("test_*.py")) if f"tests/{f.name}" not in page]
    assert unnamed == []


# Settings the code reads that are not an operator's: the demo's own processes, the test suite's fault
# points and span capture, and what a worker tells the processes it starts.
INTERNAL_SETTINGS = {
    "AGENTPOOL_DEMO_MODEL",
    "AGENTPOOL_DEMO_OUTBOX",
    "AGENTPOOL_FAULTS",
    "AGENTPOOL_FAULT_ARMS",
    "AGENTPOOL_FAULT_DIR",
    "AGENTPOOL_TEST_SPANS",
    "AGENTPOOL_TEST_SPANS_HANG",
    "AGENTPOOL_WORKER_PARENT",
}


def test_every_setting_the_code_reads_is_in_the_configuration_table():
    named = set()
    for source in [*(ROOT / "workers").rglob("*.py"), *(ROOT / "store").rglob("*.py")]:
        named.update(re.findall(r"[\"'](AGENTPOOL_[A-Z0-9_]+)[\"']", source.read_text()))
    assert len(named) > 30, named  # the pattern still finds them
    rows = [line for line in (ROOT / "docs" / "operations.md").read_text().splitlines() if line.startswith("| `")]
    first_cells = " ".join(row.split("|")[1] for row in rows)
    missing = sorted(name for name in named - INTERNAL_SETTINGS if f"`{name}`" not in first_cells)
    assert missing == [], f"settings missing from docs/operations.md's configuration table: {missing}"
