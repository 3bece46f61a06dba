"""One version number: ``turnrl.__version__``, read by the package build and named by the
CHANGELOG's top entry (a release names it exactly; "Unreleased (X)" is a pre-release of X)."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version
from setuptools.config.pyprojecttoml import read_configuration

import turnrl

ROOT = Path(__file__).resolve().parent.parent


def top_entry(changelog: str) -> tuple[str, bool]:
    """The version the first ``## `` heading names, and whether it is marked unreleased."""
    heading = next(line for line in changelog.splitlines() if line.startswith("## "))
    found = re.match(r"## (?:Unreleased \((?P<next>[^)]+)\)|(?P<released>\S+))", heading)
    if not found:
        raise ValueError(f"CHANGELOG heading names no version: {heading!r}")
    return found["next"] or found["released"], found["next"] is not None


def matches_entry(version: str, entry: str, unreleased: bool) -> bool:
    """A release's version is its entry's; work towards entry X is a pre-release of X."""
    parsed = Version(version)
    if unreleased:
        return parsed.is_prerelease and parsed.base_version == Version(entry).base_version
    return parsed == Version(entry)


def test_the_package_version_is_the_changelogs_top_entry():
    entry, unreleased = top_entry((ROOT / "CHANGELOG.md").read_text())
    assert matches_entry(turnrl.__version__, entry, unreleased), (
        f"turnrl.__version__ {turnrl.__version__} does not match CHANGELOG.md's top entry "
        f"{entry}{' (unreleased)' if unreleased else ''}; change one of them")


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project, "pyproject.toml writes a version; let it read turnrl's"
    assert "version" in project["dynamic"]
    built = read_configuration(ROOT / "pyproject.toml", expand=True)["project"]
    assert built["version"] == turnrl.__version__


@pytest.mark.parametrize("version, entry, unreleased, ok", [
    ("0.4.0.dev0", "0.4.0", True, True),
    ("0.4.0rc1", "0.4.0", True, True),
    ("0.4.0", "0.4.0", True, False),       # a release under an "Unreleased" heading
    ("0.3.0.dev0", "0.4.0", True, False),  # work towards another version
    ("0.4.0", "0.4.0", False, True),
    ("0.4.0.dev0", "0.4.0", False, False),  # the entry says released, the package does not
    ("0.4.1", "0.4.0", False, False),
])
def test_the_match_rule(version, entry, unreleased, ok):
    assert matches_entry(version, entry, unreleased) is ok


def test_headings_are_read_as_written():
    assert top_entry("# Changelog\n\n## Unreleased (0.4.0)\n\n## 0.3.0 — x\n") == ("0.4.0", True)
    assert top_entry("# Changelog\n## 0.3.0 — one step (unreleased)\n") == ("0.3.0", False)
    with pytest.raises(ValueError, match="names no version"):
        top_entry("## \n")
