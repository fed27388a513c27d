"""Packaging metadata: requirements.txt pins exactly pyproject's core dependencies; the license is
declared (PEP 639 expression) and its text ships at the repository root."""

import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _pins(lines) -> dict[str, str]:
    """{normalised name: version} of `name==version` requirement lines; anything else fails."""
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier  # exactly one, an exact pin
        assert specifier.operator == "==", f"not pinned with ==: {line!r}"
        name = canonicalize_name(requirement.name)
        assert name not in pins, f"{name} listed twice"
        pins[name] = specifier.version
    return pins


def test_requirements_txt_mirrors_project_dependencies():
    in_pyproject = _pins(_pyproject()["project"]["dependencies"])
    in_requirements = _pins((ROOT / "requirements.txt").read_text().splitlines())
    assert in_requirements == in_pyproject


def test_license_is_apache_2_0():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_ruff_lint_and_format_are_clean():
    """The configuration in pyproject.toml ([tool.ruff]); `ruff check --fix . && ruff format .` fixes most."""
    import subprocess
    import sys

    for args in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"ruff {' '.join(args)}:\n{done.stdout}{done.stderr}"
