"""The user's guide holds together: every link of README.md, docs/*.md and bench/README.md
resolves (file and #anchor), no page cites a file a user does not have, the README stays a
short guide, and docs/config.md is what scripts/config_reference.py writes from the schema."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The text outside fenced code blocks, where links are live."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_githubs_rule():
    assert slug("Several tasks in one run: `tasks:` and dynamic task weights") == (
        "several-tasks-in-one-run-tasks-and-dynamic-task-weights")
    assert slug("LM speed against TRL: grpo_vs_trl.py") == "lm-speed-against-trl-grpo_vs_trlpy"
    assert slug("SD3 and Wan (diffusers pipelines)") == "sd3-and-wan-diffusers-pipelines"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_is_a_short_guide_with_every_topic_one_click_away():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "Quickstart" in text
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(prose(text))}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), "docs pages the README does not link"


def test_no_user_facing_text_cites_a_file_users_do_not_have():
    hits = subprocess.run(["grep", "-rln", "FINDINGS", "regen", "docs", "README.md", "examples", "bench"],
                          cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert hits == []


def test_no_dated_figure_outside_a_line_that_links_to_the_benchmarks():
    date = re.compile(r"(?<![\w-])20\d\d-\d\d-\d\d(?![\w-])")  # not inside a file name
    stray = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if date.search(line) and "bench/README.md" not in line and "config.md" not in page.name:
                stray.append(f"{page.name}:{n}")
    assert stray == []


def test_config_reference_is_current():
    out = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("verb", ["train", "sft", "rm"])
def test_help_config_and_the_reference_page_say_the_same(verb, capsys):
    """Each key's type and default as `regen VERB --help-config` prints them, in the page's table."""
    from regen.cli.main import main

    assert main([verb, "--help-config"]) == 0
    printed = re.findall(r"^(\S+)\s+(.+?) = (.+)$", capsys.readouterr().out, re.M)
    page = (ROOT / "docs" / "config.md").read_text().split(f"## regen {verb}\n")[1].split("\n## ")[0]
    table = {m[0]: (m[1].replace("\\|", "|"), m[2].replace("\\|", "|"))
             for m in re.findall(r"^\| `([^`]+)` \| (.*?) \| `(.*?)` \|", page, re.M)}
    assert len(printed) > 40 and {k: (t, d) for k, t, d in printed} == table
