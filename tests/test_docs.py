"""The manual: built strict, its generated pages as the code defines them, every refusal the
code prints with an entry in troubleshooting, and README a front door that stays in the
repository."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from operations.plans import settings as settings_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _gen():
    spec = importlib.util.spec_from_file_location("tools_docs_gen", ROOT / "tools" / "docs_gen.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


gen = _gen()


def test_every_key_has_help_and_no_help_without_a_key():
    keys = {f.name for f in dataclasses.fields(settings_module.Settings)}
    assert sorted(keys - set(settings_module.HELP)) == [], "declare its sentence"
    assert sorted(set(settings_module.HELP) - keys) == []


def test_reference_page_is_the_settings():
    """docs/reference.md is what tools/docs_gen.py makes from operations/plans/settings.py now: run
    `.venv/bin/python tools/docs_gen.py` after changing a key."""
    assert (DOCS / "reference.md").read_text(encoding="utf-8") == gen.reference_page()


def test_reference_names_each_key_with_its_default_and_rule():
    page = (DOCS / "reference.md").read_text(encoding="utf-8")
    for field in dataclasses.fields(settings_module.Settings):
        section = page.split(f"### `gpuhost_{field.name}`\n", 1)[1].split("\n### ", 1)[0]
        assert settings_module.RULES[field.name].allowed in section
        assert f"- type: `{field.type}`" in section
        assert f"- default: `{gen._python(gen._default(field))}" in section


def test_every_reading_module_has_a_stage():
    """A module that reads a setting and belongs to no stage would show as '?' in the
    reference: name its stage in tools/docs_gen.STAGES."""
    modules = set().union(*gen.readers().values())
    assert sorted(modules - set(gen.STAGES)) == []


def test_readers_follow_settings_reads():
    reads = gen.readers()
    assert "nvidia" in reads["allow_driver_change"]
    assert "deploy_lock" in reads["deploy_lock_wait"]
    # through a property: router_lock_path reads router_lock
    assert "router" in reads["router_lock"]
    # a driver's version read off nvidia-smi is no setting
    assert "nvsmi" not in reads["driver_version"]


def test_troubleshooting_stack_table_is_the_stack_facts():
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    assert gen.STACK_BEGIN in text and gen.STACK_END in text
    assert text == gen.troubleshooting_page(text)


def _pattern(words: str) -> re.Pattern[str]:
    """The first words of a refusal, "…" matching any value (or "…" itself)."""
    parts = [re.escape(p) for p in gen.normalise(words).rstrip(".,;:(").split("…")]
    return re.compile(r".{0,80}?".join(parts))


def test_every_refusal_has_an_entry():
    """Each refusal the code can print (tools/docs_gen.refusals) has an entry in
    docs/troubleshooting.md: under a heading naming its stage, quoting its first words."""
    text = gen.normalise((DOCS / "troubleshooting.md").read_text(encoding="utf-8"))
    headings = re.findall(r"^## (.+)$", (DOCS / "troubleshooting.md").read_text(
        encoding="utf-8"), re.M)
    missing = []
    for refusal in gen.refusals():
        if not any(refusal.stage.lower() in h.lower() for h in headings):
            missing.append(f"{refusal.where}: no '## {refusal.stage}' section")
        elif refusal.words and not _pattern(refusal.words).search(text):
            missing.append(f"{refusal.where}: [{refusal.stage}] {refusal.words!r}")
    assert missing == []


def test_refusals_are_found_through_values():
    """The scan follows a reason given as a value to where its text is made."""
    found = {(r.stage, r.words) for r in gen.refusals()}
    stages = {stage for stage, _ in found}
    assert {"Preflight", "NVIDIA", "ML venv", "Stack", "deploy lock", "Bench",
            "gpuhost"} <= stages
    # plan_driver's refusals list, reached through `for reason in (*plan.refusals, ...)`
    assert any(w.startswith("no kernel headers for the running") for _, w in found)
    # a function's return value (venvs.room_problem)
    assert any(w.startswith("no room for the new venv") for _, w in found)
    # a refusal row of operations/stack_facts.FACTS
    assert ("Stack", "flashinfer-trtllm-moe-sm12x:") in found


def test_a_new_refusal_without_an_entry_fails(tmp_path, monkeypatch):
    """The check is real: a refusal the page does not quote is reported."""
    page = tmp_path / "troubleshooting.md"
    page.write_text((DOCS / "troubleshooting.md").read_text(encoding="utf-8"))
    refusal = gen.Refusal("Preflight", "the host is made of cheese", "operations/x.py:1")
    text = gen.normalise(page.read_text())
    assert not _pattern(refusal.words).search(text)


def test_readme_is_a_front_door():
    """README.md: at most about 200 lines, bin/quickstart and bin/test its first commands (CI
    runs the test command), every link inside the repository, and the manual's pages linked."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 210
    commands = re.findall(r"^    (bin/\S+)", readme, re.M)
    assert commands[:2] == ["bin/quickstart", "bin/test"]
    links = re.findall(r"\]\(([^)]+)\)", readme)
    outside = [link for link in links if link.startswith("..")
               or (re.match(r"[a-z]+://", link) and "pyinfra.com" not in link)]
    assert outside == []
    for link in links:
        if not re.match(r"[a-z]+://", link):
            assert (ROOT / link.split("#")[0]).exists(), link
    for page in ("first-deploy.md", "dry-run.md", "upgrades.md", "fleet.md", "reference.md",
                 "troubleshooting.md"):
        assert f"docs/{page}" in readme


def test_no_page_links_out_of_the_repository():
    for page in DOCS.glob("*.md"):
        assert "../shared/" not in page.read_text(encoding="utf-8"), page


def test_manual_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing anchor or a page left out of the nav
    fails."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    result = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "reference" / "index.html").is_file()


def test_the_newcomers_questions_are_answered_one_click_from_readme():
    """Issue #33's questions: each answered on a page README links to, with a command to copy."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    answers = {
        "first-deploy.md": ["## As a sudo user", "## Secure Boot", "## Supported systems"],
        "dry-run.md": ["## What the table's columns mean", "Conditional Change",
                       "    .venv/bin/pyinfra inventory/lab.py deploy.py --dry --data "
                       "gpuhost_driver_branch=590 --data gpuhost_allow_driver_change=true"],
        "upgrades.md": ["## Rollback by hand", "--data gpuhost_rollback=true",
                        "last_known_good.py restore"],
        "reference.md": [f"### `gpuhost_{name}`" for name in settings_module.RULES],
    }
    for page, needles in answers.items():
        assert f"](docs/{page})" in readme, page
        # a command continued on the next line (" \\" and an indent) reads as one line
        text = re.sub(r" \\\n +", " ", (DOCS / page).read_text(encoding="utf-8"))
        assert [n for n in needles if n not in text] == [], page


def test_refusals_raised_while_executing_are_found():
    """An error raised with "refused: ..." (bench.py's health gate) is a refusal too."""
    found = {(r.stage, r.words) for r in gen.refusals()}
    assert any(stage == "bench.py" and words.startswith("sglang.service is not healthy")
               for stage, words in found)
