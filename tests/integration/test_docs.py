"""The documentation site builds: `mkdocs build --strict` on mkdocs.yml and docs/, as `make docs`.

Strict mode turns every warning into an error: a link to a page or file that does not exist, a
page left out of the nav, a README section the Install or Quickstart page includes that is gone.
The examples on the pages are run by test_readme_examples.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(180)]


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_the_site_builds_strictly_with_every_page(tmp_path: Path) -> None:
    run = build(tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        out = tmp_path / "site" / ("index.html" if page == "index" else f"{page}/index.html")
        assert out.is_file(), f"docs/{page}.md was not built"
    # The Install and Quickstart pages include their README sections (pymdownx.snippets).
    install = (tmp_path / "site" / "install" / "index.html").read_text()
    assert "<code>tardigrade-ckpt</code>" in install and "<code>make demo</code>" in install
    quickstart = (tmp_path / "site" / "quickstart" / "index.html").read_text()
    assert "<code>CheckpointExistsError</code>" in quickstart
    assert "<code>CheckpointNotFoundError</code>" in quickstart
    assert not re.search(r"--8&lt;|--8<--", install + quickstart), "a snippet was not included"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check has teeth: the same site with a link to a missing page does not build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n")
    config = tmp_path / "mkdocs.yml"
    text = (ROOT / "mkdocs.yml").read_text()
    text = re.sub(r"^docs_dir: .*$", f"docs_dir: {docs}", text, flags=re.M)
    text = text[: text.index("\nnav:")] + "\nnav:\n  - Home: index.md\n"
    config.write_text(text)
    run = build(tmp_path / "site", config)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "missing.md" in run.stderr, run.stderr
