"""The documentation a user reads (README.md, docs/*.md, the entry points' --help) is
reference, not a lab notebook: it names no internal issue numbers, work sessions, labelled
runs with their clock times, dates or commit hashes. Git history keeps those.

Each rule below is one regular expression for one kind of work-log text; a line that
matches any of them fails the check, which names the file, the line and the rule.
Results pages under docs/results/ are tool output (they may quote dated log lines) and
are not checked here.
"""
from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A log line's own timestamp ("[2026-12-03 07:41:06.097027] iteration ...") is the log
# format a page shows, not a date of the page's history.
_LOG_STAMP = r"(?<!\[)"

RULES = {
    # "issue 12", "issues 11 and 31", "issue #29", "Issue 11 asked"; a link to another
    # project's tracker (.../issues/132644) is a reference and passes.
    "issue number": re.compile(r"\bissues?\s+#?\d+", re.I),
    "pull request number": re.compile(r"\b(?:PR|pull request)\s*#\d+", re.I),
    "an issue's item or target": re.compile(r"\b(?:the|this|that) issue's\b|\bitems? \d+(?:-\d+)? of issue\b", re.I),
    # "session 7", "(session 9)", "the last session's note", "no session has had ..."
    "work session": re.compile(
        r"\bsessions? \d+|\(session\b|\b(?:last|previous|earlier|later|this|next|no|work|lab)"
        r" session(?:'s|s)?\b", re.I),
    # "Run A (the picture): 18:37", "run B", "| run C |"
    "labelled run": re.compile(r"\b[Rr]uns? [A-E](?: and [A-E])?\b(?![\w.(-])"
                               r"|\bRun [A-Z0-9]+\b.*\d\d:\d\d"),
    # "run 5's", "since run 8;", "runs 4 and 5,", "(run 4)", "Run 3:", "| run 2 |"; not a
    # count ("runs 30 iterations") nor a range ("run 1 .. L")
    "numbered run": re.compile(
        r"\b[Rr]uns? \d+(?:(?:-| and |, )\d+)*(?=[)':;,]|\.(?!\d)|$| \(| \|)"
        r"|\b(?:since|in|from|than|before|after|until) runs? \d+\b|\b[Rr]uns \d+(?:-| and )\d+\b"),
    "clock time of a run": re.compile(r"(?<![\w:.])(?:[01]\d|2[0-3]):[0-5]\d(?![\w:])"),
    "machine load of a run": re.compile(r"\bload (?:average )?\d+(?:\.\d+)? (?:before|after)\b"),
    # "2026-12-05"; a log line's "[2026-12-05 03:58:03..." is output, not a date of history
    "date": re.compile(_LOG_STAMP + r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "month and year": re.compile(
        r"\b(?:January|February|March|April|May|June|July|August|September|October|November"
        r"|December) 20\d\d\b"),
    # "at commit d9733a2", "(ed70f67)", "4b8147d:": a short hash standing alone in prose,
    # not part of a file name, a checksum field or a longer identifier
    "commit hash": re.compile(
        r"\bcommits? [0-9a-f]{7,40}\b"
        r"|(?<![\w./-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w/-]|\.\w)"),
    # narratives of who decided what, and when
    "work-log wording": re.compile(
        r"\blead's call\b|\bfixed since\b|\bat the time of this (?:measurement|writing)\b"
        r"|\buntil commit\b|\bsee the (?:last|latest) note\b", re.I),
}


def offending_lines(text: str) -> list:
    """(line number, rule, line) for every line of `text` a rule matches."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for rule, pattern in RULES.items():
            if pattern.search(line):
                out.append((number, rule, line.strip()))
    return out


def doc_files() -> list:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _report(found: dict) -> str:
    return "\n".join(f"{name}:{n}: [{rule}] {line[:160]}"
                     for name, rows in found.items() for n, rule, line in rows)


def test_the_check_catches_planted_lines() -> None:
    planted = [
        "Measured in session 7 (see issue 12).",
        "before (session 9) it was slower",
        "see the last session's note",
        "### Run A (the picture): 18:37, load 0.78 before and 2.00 after, 80 s",
        "Run on 2026-12-05 at commit d9733a2 in a clean worktree",
        "| before (ed70f67) | glibc default | 0.971 |",
        "the per-direction link groups, 4b8147d: 1.010",
        "Since run 8 the 6 fastest plans run 3 more times; runs 4 and 5 met all three.",
        "**Run 3: the profile in rounds** (44 minutes)",
        "Fixed since: the trainer defers the step.",
        "The summary states the verdict on each target of Issue #29.",
    ]
    for line in planted:
        assert offending_lines(line), line


def test_the_check_lets_reference_text_pass() -> None:
    clean = [
        "Each configuration runs as 4 short sessions, and each session leaves out its warm-up.",
        "[2026-12-03 07:41:06.097027] iteration       10/      20 | consumed samples: 80",
        "bert_lr1e-3_2bw-adam_seed1_drop0_it300_3e14f4a002.json",
        "isend/irecv hangs on gloo (https://github.com/pytorch/pytorch/issues/132644)",
        "rendezvous at HOST:PORT, e.g. 127.0.0.1:56357",
        "torchrun --nproc-per-node 4 pretrain_gpt.py --lr 1.5e-4 --seq-length 1024",
        "run it with `carry: [\".whl\"]`; Run it on a GPU",
        "sha256 of every rank file; `--ckpt-step 20`; 0.978 / 1.052",
        "the slowest arm runs 30 iterations; windows run 1 .. L, as in training",
    ]
    for line in clean:
        assert not offending_lines(line), (line, offending_lines(line))


def test_docs_carry_no_work_log() -> None:
    found = {}
    for path in doc_files():
        with open(path, encoding="utf-8") as f:
            rows = offending_lines(f.read())
        if rows:
            found[os.path.relpath(path, ROOT)] = rows
    assert not found, "work-log text in the docs:\n" + _report(found)


def test_help_carries_no_work_log() -> None:
    from megatron_2bw.training.arguments import build_parser
    found = {}
    for model in ("gpt", "bert"):
        rows = offending_lines(build_parser(model).format_help())
        if rows:
            found[f"pretrain_{model}.py --help"] = rows
    assert not found, "work-log text in --help:\n" + _report(found)
