"""The README and docs/ stay true to the repository: its examples are the shipped files, its
links resolve, and its size stays that of a user guide (docs/benchmarks.md holds the record)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")  # hex, letters and digits


def code_blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of one language, in order."""
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def body_from(code: str, first: str) -> list[str]:
    """The non-blank lines of ``code`` from the first line starting with ``first`` on."""
    lines = [line for line in code.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    return lines[start:]


def contiguous_in(needle: list[str], haystack: list[str]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack)))


@pytest.mark.parametrize("example, first", [
    ("examples/calculator_env.py", '@register_env("calculator")'),
    ("examples/tool_task.py", "@tool"),
])
def test_the_readme_shows_the_shipped_example_verbatim(example, first):
    shown = [b for b in code_blocks(README.read_text(), "python") if first in b]
    assert len(shown) == 1, f"README shows {first} {len(shown)} times"
    shipped = [line for line in (ROOT / example).read_text().splitlines() if line.strip()]
    body = body_from(shown[0], first)
    assert contiguous_in(body, shipped), f"README's {example} differs from the file"


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {github_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def local_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_local_link_resolves(doc):
    broken = []
    for target in local_links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.name}: links to nothing: {broken}"


def test_the_anchor_rule_matches_githubs():
    assert github_anchor("The default job (`make train`)") == "the-default-job-make-train"
    assert github_anchor("Async: sync vs async under slow tools") == \
        "async-sync-vs-async-under-slow-tools"


def test_the_readme_stays_a_guide():
    """History belongs in docs/benchmarks.md: dates and commit hashes only in the headline table."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 490, f"README has {len(lines)} lines; move detail to docs/"
    prose = [line for line in lines if not line.startswith("|")]
    dated = [line for line in prose if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    hashed = [line for line in prose if COMMIT.search(line)]
    assert not dated and not hashed, f"dates or commits outside the table: {dated + hashed}"
