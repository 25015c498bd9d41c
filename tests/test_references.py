"""The repository explains itself: no file points to design notes users do not have, or to issue numbers (both
rot); the design lives in docs/design/, one file per topic. Scans every tracked text file."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(r"DESIGN\.md|\.\./shared|\b[Ii]ssues? #?\d+")


def test_no_reference_to_missing_files_or_issue_numbers() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        if not name.endswith((".py", ".md", ".sh", ".json", ".txt", ".toml", ".cfg")) and name != ".ci/run":
            continue
        if name == "tests/test_references.py":
            continue
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def _tracked_texts() -> dict[str, str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {f: (ROOT / f).read_text(errors="replace") for f in files
            if f.endswith((".py", ".md", ".sh")) and (ROOT / f).is_file() and f != "tests/test_references.py"}


def _words(text: str) -> str:
    return " ".join(text.replace("#", " ").split())


def test_design_notes_one_file_per_topic_and_every_reference_resolves() -> None:
    """docs/design/ holds one file per topic (none over 300 lines) and an index with the glossary; every cited
    design file exists, and every ``Note [...]`` cited anywhere is written down in docs/design/ or in the code."""
    design = ROOT / "docs" / "design"
    index = (design / "index.md").read_text()
    assert "## Glossary" in index and "The ring count, from the JSON to the kernel" in index
    long = [f"{p.name}: {n}" for p in design.glob("*.md") if (n := len(p.read_text().splitlines())) > 300]
    assert not long, long
    texts = _tracked_texts()
    files = {m for t in texts.values() for m in re.findall(r"docs/design/([\w-]+)\.md", t)}
    assert files and all((design / f"{f}.md").is_file() for f in files), files
    written = _words(" ".join(p.read_text() for p in design.glob("*.md")))
    defined = {_words(m) for t in texts.values() for m in re.findall(r"^\s*(?:#\s*)?Note \[([^\]]+)\][.:]", t, re.M)}
    cited = {_words(n) for t in texts.values() for n in re.findall(r"Note \[([^\].]+)\]", t)}  # "Note [...]": any
    missing = sorted(n for n in cited if f"Note [{n}]" not in written and n not in defined)
    assert not missing, missing
    code = [f for f, t in texts.items() if f.startswith("ds_wallfacer/") and "docs/design/" in t]
    assert len(code) >= 10, code
