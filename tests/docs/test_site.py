"""The documentation site builds strictly (a broken link, anchor or snippet fails), offline, and the README is the
short front door it points from: at most 300 lines, the two quick-start commands, links that resolve, and no page
that labels a figure by a work period."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def test_the_site_builds_strictly_and_fetches_nothing(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed (run `make docs`):\n{done.stderr[-4000:]}"
    site = tmp_path / "site"
    for page in ("index.html", "getting-started.html", "reference/configuration.html", "reference/http-api.html",
                 "reference/openapi.json", "benchmarks.html", "design.html"):
        assert (site / page).is_file(), f"{page} missing from the built site"
    production = (site / "operations" / "production.html").read_text()
    web = next(line for line in (ROOT / "Procfile").read_text().splitlines() if line.startswith("web:"))
    assert web.split(":", 1)[1].strip().replace("$PORT", "") in production.replace("$PORT", ""), \
        "the production page does not show the Procfile's web line"
    fetched = set()
    for html in site.rglob("*.html"):
        fetched |= set(re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?://[^"]+)"', html.read_text()))
    assert not fetched, f"pages load resources from the network: {sorted(fetched)[:5]}"


def test_the_readme_is_short_and_shows_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "make run" in text and "make test" in text


def test_the_readmes_links_resolve():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links to no page"
    missing = [t for t in targets if not t.startswith(("http://", "https://")) and not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


WORK_PERIODS = re.compile(r"\b(session \d+|sessions? \d+ and \d+|sitting|sittings|run \d+ of)\b", re.I)


def test_no_page_labels_a_figure_by_a_work_period():
    offenders = []
    for path in [README, *PAGES]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if WORK_PERIODS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)
