"""The documentation: the MkDocs site builds in strict mode, and the README stays a short guide."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


# the file names of the project's internal planning specs, which the repository never cites: its docs are the reference
INTERNAL_SPEC = re.compile(r"SCHEMES(?:_WAVE\d+)?\.md|REFERENCE_RESULTS\.md")


def _repository_text_files() -> list[Path]:
    folders = ("docs", "visionpe", "tests", "train", "bench", "configs", "scripts", "assets")
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", ROOT / "pyproject.toml"]
    for folder in folders:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".sh", ".txt"}]
    return files


def test_no_file_cites_internal_specs():
    offending = [
        str(p.relative_to(ROOT))
        for p in _repository_text_files()
        if INTERNAL_SPEC.search(p.read_text(encoding="utf-8"))
    ]
    assert not offending, f"these files cite an internal spec: {offending}"
