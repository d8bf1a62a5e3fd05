"""The documentation: README.md's quickstart runs as written, and the MkDocs site builds strictly.

README.md is the front page and docs/ the site (mkdocs.yml). The quickstart and the install section are
written once, in the README between ``<!-- --8<-- [start:NAME] -->`` markers, and docs/index.md includes
them. The configuration reference and the object storage example are checked by test_config.py and
test_object_config.py.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import mkdocs  # noqa: F401  (the docs extra, which the test extra installs: missing is a failure, not a skip)
import pytest
from markdown.extensions.toc import slugify

from tierckpt import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def readme_section(name: str) -> str:
    """The text between the README's snippet markers ``[start:name]`` and ``[end:name]``."""
    text = readme()
    start = re.search(rf"^<!-- --8<-- \[start:{name}\] -->$", text, re.M)
    end = re.search(rf"^<!-- --8<-- \[end:{name}\] -->$", text, re.M)
    assert start and end, f"README.md has no snippet section {name!r}"
    return text[start.end() : end.start()]


def quickstart_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", readme_section("quickstart"), re.S)
    assert len(blocks) == 1, "the quickstart is one python block"
    return blocks[0]


def run_python(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    # This checkout's tierckpt, whatever is installed; warnings are errors, as in the tests themselves.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-W", "error", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_readme_starts_with_the_two_commands_and_stays_a_front_page() -> None:
    text = readme()
    first = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first is not None and text.index("```bash") < text.index("\n## ")
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]  # CI calls scripts/test.sh
    assert len(text.splitlines()) <= 300


@pytest.mark.slow
def test_the_quickstart_runs_as_written_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    first = run_python(script, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "resumed" not in first.stdout
    reached = re.search(r"^trained to step (\d+)$", first.stdout, re.M)
    assert reached is not None, first.stdout
    step = int(reached.group(1))
    assert step == 49
    assert (tmp_path / "checkpoints" / "disk" / f"step-{step:012d}").is_dir()

    second = run_python(script, tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"resumed from step {step}\n" in second.stdout
    assert f"trained to step {step + 50}\n" in second.stdout


def test_the_minimal_yaml_is_the_quickstarts_config(tmp_path: Path) -> None:
    tree = ast.parse(quickstart_code())
    assigned = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "config"]
    assert len(assigned) == 1
    as_dict = ast.literal_eval(assigned[0])
    section = readme()[readme().index("## A minimal YAML") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    (tmp_path / "tiers.yaml").write_text(block.group(1))
    assert Config.from_yaml(tmp_path / "tiers.yaml") == Config.from_dict(as_dict)


def headings(path: Path) -> set[str]:
    """The anchors MkDocs gives the headings of a page (the toc extension's default slugs)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slugify(re.sub(r"[`*]", "", h).strip(), "-") for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readmes_links_lead_somewhere() -> None:
    """Links from the README are relative paths into the repository (so they work on GitHub), and an
    anchor names a heading of the page it points to. Links between docs/ pages: the strict build."""
    links = re.findall(r"\]\(([^)\s]+)\)", readme())
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in headings(target), f"README.md links to {link}: no such heading"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav, every link and anchor between pages resolves,
    and the README sections docs/index.md includes exist."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "restore_latest_sync" in index and "download.pytorch.org/whl/cpu" in index  # the README's snippets


def test_contributing_states_the_size_of_the_suite_and_of_its_quick_subset(request: pytest.FixtureRequest) -> None:
    from conftest import SUITE_COUNTS

    counts = request.config.stash.get(SUITE_COUNTS, None)
    if counts is None:
        pytest.skip("this run collected part of tests/: the counts are checked by a run of the whole suite or a subset of it by marker")
    text = (ROOT / "docs" / "contributing.md").read_text()
    found = re.search(r"the quick subset runs\s+(\d+)\s+of\s+its\s+(\d+)\s+tests", text)
    assert found, "docs/contributing.md no longer says how many tests the quick subset runs"
    quick, total = int(found.group(1)), int(found.group(2))
    # Within a tenth: a test added needs no edit, a subset that grew or shrank by much does (and its times with it).
    assert abs(total - counts["all"]) <= counts["all"] // 10, (total, counts)
    assert abs(quick - (counts["all"] - counts["slow"])) <= counts["all"] // 10, (quick, counts)
