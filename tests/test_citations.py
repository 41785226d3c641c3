"""Every seed section the project cites exists, and a cited heading lies in the section whose id is cited.

The contract text is the two seeds (M3.10 ``000_fd0eeea1d5d69cd8.txt``, M3.8
``003_27f4ca93d579229d.txt``); they are not part of the repository, so ``tests/seed_sections.json``
holds their section ids and headings (rebuilt from the seeds by :func:`seed_index` and compared
with them when the seeds are present: ``$DECODESPEC_SEEDS``, else ``../shared/seeds`` beside the
checkout).  Cited are the ``section`` of every registered rule, error code and failure-lab
mutant, and every ``M3.10 0xNN`` / ``M3.8 0xNN`` citation in the tracked sources and docs: the
id must be one of the seed's, and when the words after it start with one of the seed's headings
(``0x0B "A completed output ..."``), that heading must be in the cited section (it is in 0x0BA).

Source: seeds README ("Cite them by module and section"); issue 17 item 3 (section ids cited wrongly).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INDEX_PATH = Path(__file__).resolve().parent / "seed_sections.json"
SEED_FILES = {"M3.10": "000_fd0eeea1d5d69cd8.txt", "M3.8": "003_27f4ca93d579229d.txt"}
_SECTION = re.compile(r"^(0x[0-9A-F]{2,3}) (.+)$")


def seed_index(text: str) -> dict:
    """``{"sections": {id: title}, "headings": [[heading, id], ...]}`` of one seed's text.

    A section starts at a line ``0xNN Title``; a heading is a short capitalised line standing
    alone between blank lines (no sentence punctuation at its end, no formula or field syntax).
    """
    lines = text.splitlines()
    sections: dict[str, str] = {}
    headings: list[list[str]] = []
    current = None
    for i, line in enumerate(lines):
        match = _SECTION.match(line)
        if match:
            current = match.group(1)
            sections[current] = match.group(2).strip()
            headings.append([match.group(2).strip(), current])
            continue
        alone = not (lines[i - 1].strip() if i else "") and not (lines[i + 1].strip() if i + 1 < len(lines) else "")
        if (current and alone and 8 <= len(line) < 110 and line[:1].isupper() and "\t" not in line
                and not line.rstrip().endswith((".", ":", ",")) and not set("$:=[") & set(line)):
            headings.append([line.strip(), current])
    return {"sections": sections, "headings": headings}


INDEX = json.loads(INDEX_PATH.read_text(encoding="utf-8"))


def _seeds_dir() -> Path | None:
    path = Path(os.environ.get("DECODESPEC_SEEDS", ROOT.parent / "shared" / "seeds"))
    return path if all((path / name).is_file() for name in SEED_FILES.values()) else None


@pytest.mark.skipif(_seeds_dir() is None, reason="the seeds are not beside the checkout (set DECODESPEC_SEEDS)")
def test_the_index_is_the_seeds_own():
    seeds = _seeds_dir()
    assert seeds is not None
    for module, name in SEED_FILES.items():
        assert INDEX[module] == seed_index((seeds / name).read_text(encoding="utf-8")), module


def citation_problem(module: str, section_id: str | None, words: str) -> str | None:
    """Why ``<module> <section_id> <words>`` cites wrongly, or ``None``.

    ``section_id`` must be one of the seed's ids; a heading that ``words`` start with (or that
    starts with ``words``) must lie in that section.  Words that name no heading are not judged.
    """
    index = INDEX[module]
    if section_id is not None and section_id not in index["sections"]:
        return f"{module} has no section {section_id}"
    words = re.sub(r"\s*\(.*$", "", words).strip().strip('"').lower()
    if len(words) < 8:
        return None
    found = {sid for heading, sid in index["headings"]
             if heading.lower().startswith(words[:40]) or words.startswith(heading.lower())}
    if not found:
        return None if section_id is not None else f"{module} has no heading {words!r}"
    if section_id is not None and section_id not in found:
        return f"{words!r} is in {module} {', '.join(sorted(found))}, not {section_id}"
    return None


def section_problems(section: str) -> list[str]:
    """Problems of one ``section`` string: ``;``-separated parts, each ``[M3.10|M3.8] [0xNN] words``.

    A part without a module inherits the previous part's; a part naming another source (docs/,
    a peer, research/) ends the inheritance.
    """
    problems = []
    module = None
    for part in (p.strip() for p in section.split(";")):
        named = re.match(r"^(M3\.10|M3\.8)\b\s*(.*)$", part)
        if named:
            module, part = named.group(1), named.group(2)
        elif not re.match(r"^0x[0-9A-F]{2,3}\b", part):
            if re.match(r"^[a-z]+/|^[A-Za-z.]+\.(md|py)\b|^(HF|vLLM|llama|gpt|Meta|PyTorch|research|issue)", part):
                module = None
            if module is None or len(part) < 8:
                continue
        if module is None:
            continue
        match = re.match(r"^(0x[0-9A-F]{2,3})\b\s*(.*)$", part)
        sid, words = (match.group(1), match.group(2)) if match else (None, part)
        if match is None:
            continue  # a bare phrase under a module is judged only with an id (prose, not always a heading)
        why = citation_problem(module, sid, words)
        if why:
            problems.append(why)
    return problems


def _registered_sections() -> list[tuple[str, str]]:
    import decodespec.checks.lab.mutants.harness  # registers every mutant
    import decodespec.checks.modelcheck.trace_validation
    import decodespec.impl.runtime
    import decodespec.spec.invariants
    import decodespec.spec.transitions  # noqa: F401 - registers the transition rules
    from decodespec.checks.lab.mutants import MUTANTS
    from decodespec.spec.errors import ERROR_CODES
    from decodespec.spec.rules import RULES

    out = [(f"rule {r.id}", r.section) for r in RULES.values()]
    out += [(f"code {c.code}", c.section) for c in ERROR_CODES.values()]
    out += [(f"mutant {m.name}", m.section) for m in MUTANTS.values()]
    return [(name, section) for name, section in out if section]


def test_every_registered_section_cites_the_right_section():
    problems = [f"{name}: {why}  [{section}]" for name, section in _registered_sections() for why in section_problems(section)]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_wrong_id():
    assert section_problems("M3.10 0x0B A completed output is not automatically a resumable snapshot")
    assert not section_problems("M3.10 0x0BA A completed output is not automatically a resumable snapshot")
    assert section_problems("M3.10 0x0F Finish reason and RNG precedence") == ["M3.10 has no section 0x0F"]
    assert section_problems("M3.8 0x12 item 42; 0x0E Score processors, repetition, and hard constraints") == []
    assert section_problems("M3.10 0x06 Stop criteria; 0x02 Finish reason and RNG precedence")


_CITATION = re.compile(r"\b(M3\.10|M3\.8),? (?:section )?(0x[0-9A-F]{2,3})\b[ ,:]*(\"?[A-Z][^;()\"\\]{6,80})?")
_CONTINUED = re.compile(r"\"?(?:\s*\([^()]*\))?\s*[;,] (0x[0-9A-F]{2,3})\b[ ,:]*(\"?[A-Z][^;()\"\\]{6,80})")


_SKIP = re.compile(r"\"?(?:\s*\([^()]*\))?\s*[;,]\s*\"[^\"]{3,120}")  # another heading of the same section


def test_every_citation_in_the_sources_cites_the_right_section():
    """Tracked .py / .md / .toml / .rst files (generated results excluded), line breaks joined."""
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml", "*.rst"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    problems = []
    for name in files:
        if name.startswith(("docs/results/", "traces/")) or name == "tests/test_citations.py":  # its own wrong examples
            continue
        flat = re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", (ROOT / name).read_text(encoding="utf-8"))
        for match in _CITATION.finditer(flat):
            module = match.group(1)
            found = [(match.group(2), match.group(3) or "")]
            tail = flat[match.end():match.end() + 400]
            while True:  # "0x06 ..., "Another heading"; 0x0A ..." under the same module
                more = _CONTINUED.match(tail)
                if more is not None:
                    found.append((more.group(1), more.group(2)))
                elif (more := _SKIP.match(tail)) is None:
                    break
                tail = tail[more.end():]
            for sid, words in found:
                why = citation_problem(module, sid, words)
                if why:
                    problems.append(f"{name}: {why}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_logprobs_aligned_cites_generated_token_logprobs():
    """invariant.logprobs_aligned is about the generated tokens' ledger, not prompt logprobs (issue 17 item 3)."""
    from decodespec.spec.rules import RULES

    section = RULES["invariant.logprobs_aligned"].section
    assert "One selection is an output-state transaction" in section and "generated-token logprobs" in section
    assert not section_problems(section)
