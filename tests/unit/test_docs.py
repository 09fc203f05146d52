"""The documentation a newcomer follows: README stays a front door, no link leads nowhere, and
every measured figure rests on a committed file that holds it."""

import bisect
import functools
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_read_in_ten_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_relative_link_in_the_docs_resolves():
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in pages()
              for target in LINK.findall(page.read_text())
              if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists()]
    assert broken == []


def test_docs_index_names_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md" and p.name not in index]
    assert missing == []


# ---------------------------------------------------------------------------------------------
# Evidence: what a command wrote, never what a person wrote.
#
# A committed file under docs/results/ is evidence for a figure when a command wrote it: a
# run's JSON, JSONL, text output, logs or effective config, and the part of a generated report
# (delay_study.md, pilot.md: their first lines name the command; kl_by_staleness.md: written
# by the script beside it) above the marker under which a person's analysis is kept. A page a
# person wrote (a README, docs/*.md) is never evidence, not even for itself: a link to a
# results folder's README stands for the files of that folder.

ANALYSIS_MARKER = "<!-- analysis:"  # lab/study.py's ANALYSIS_MARKER starts so
EVIDENCE_SUFFIXES = (".json", ".jsonl", ".txt", ".md", ".yaml", ".csv", ".log")


@functools.cache
def _is_generated(path: Path) -> bool:
    """A Markdown file a command wrote: its first lines name the command, or a script beside it
    writes it."""
    head = path.read_text(errors="replace").splitlines()[:4]
    return (any(line.startswith("Command: `") for line in head)
            or any(f'"{path.name}"' in script.read_text() for script in path.parent.glob("*.py")))


@functools.cache
def _machine_written(path: Path) -> str:
    """The text of `path` that a command wrote ('' for a page a person wrote)."""
    if path.suffix not in EVIDENCE_SUFFIXES:
        return ""
    text = path.read_text(errors="replace")
    if path.suffix != ".md":
        return text
    return text.split(ANALYSIS_MARKER, 1)[0] if _is_generated(path) else ""


def _written_by_hand(path: Path) -> str:
    """The text of a page a person wrote: a whole page, or a generated report's analysis."""
    text = path.read_text()
    if not _is_generated(path):
        return text
    return text.split(ANALYSIS_MARKER, 1)[1] if ANALYSIS_MARKER in text else ""


def _evidence_files(path: Path) -> list[Path]:
    """The files a link to `path` brings as evidence: the file, or every file of a folder (a
    results README's link: its folder), a person's pages left out by `_machine_written`."""
    if path.is_file() and path.name != "README.md":
        return [path]
    folder = path if path.is_dir() else path.parent
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix in EVIDENCE_SUFFIXES)


NUMBER = re.compile(r"(?<![\w.])(?<![\w.][-−+])[-−+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "").replace("−", "-") for n in NUMBER.findall(text)]


@functools.cache
def _file_values(path: Path) -> list[float]:
    """Every number in the machine-written text of `path` (and "16 min 47 s" as 1007), sorted."""
    text = _machine_written(path)
    values = [int(m[1]) * 60 + int(m[3]) for m in COMPOUND.finditer(text)]
    for n in _numbers(text):
        try:
            values.append(float(n.rstrip(",")))
        except ValueError:
            pass
    return sorted(v for v in values if math.isfinite(v))


# A figure in the docs may be written in another unit than its file's (minutes of a file's
# seconds, a percentage of its fraction): the factors each unit may stand at.
_BYTES = [1000.0 ** k for k in range(-3, 4)] + [1024.0 ** k for k in range(-3, 4)]
SCALES = {"": [1, 100], "%": [1, 100], "s": [1, 60], "ms": [1, 1e3], "min": [1, 1 / 60],
          "h": [1, 1 / 60, 1 / 3600], "B": _BYTES}  # "": a bare number may be a file's fraction in %


def _held(claimed: str, files: list[Path], unit: str = "") -> bool:
    """Whether one of the files holds `claimed` as written: a number that, in the claim's unit,
    is the same value at the claim's own precision (its decimals, or its significant digits for
    1.2e-7)."""
    value = float(claimed)
    if "e" in claimed.lower():
        mantissa = claimed.lower().split("e")[0]
        digits = len(mantissa.replace("-", "").replace(".", "").lstrip("0")) or 1
        half = 0.5 * 10.0 ** (math.floor(math.log10(abs(value))) - digits + 1) if value else 0.5e-12
    else:
        half = 0.5 * 10.0 ** -(len(claimed.split(".")[1]) if "." in claimed else 0)
    low, high = value - half * (1 + 1e-9), value + half * (1 + 1e-9)  # 0.3525 is 0.352 or 0.353
    for scale in SCALES.get(unit, [1]):
        lo, hi = sorted((low / scale, high / scale))
        for f in files:
            values = _file_values(f)
            i = bisect.bisect_left(values, lo - 1e-12 * abs(lo))
            if i < len(values) and values[i] <= hi + 1e-12 * abs(hi):
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Every page: a results sentence names the file that holds its figures, or says it is history.
#
# A figure is a number with a unit of measure (s, ms, min, h, %, ×, GiB, MB, tokens/s,
# steps/min, groups/s, Mbit/s, points), a span of them ("3.5–4.4 s", "35 min 16 s") or the two
# ends of a change ("0.107 -> 0.351"). A figure that is set, aimed at or computed in the text is
# not one: a default, a bound, a target, a budget, "within 5 s", "= 272 MB", "20 ± 10 ms".
#
# A results sentence states a figure as measured: it says so (took, measured, ran, reached,
# ended, gave, went, rose, fell, was, dropped, ...) or names the machine (a 2-core VM, an AMD EPYC,
# an Intel Xeon, an NVIDIA H200); on a page under docs/results/, every sentence with a figure is
# one. In a results table (a column of a measure in its header, or a header or an introducing
# sentence that says measured) every row is one, and every number of a row is a figure but its
# first cell's and those of columns that say what ran; in another table each cell's sentences are
# judged as prose. A table whose header or introduction says it is computed from a file is not
# checked, nor a sentence that says what it is computed from and names the file.
#
# Its evidence: the committed files a command wrote (above) that its sentence, row, paragraph,
# list item, the paragraph leading into its list with a colon, its table's header, introduction
# or bracketed caption, or its section's heading names: by a link, a `path` (a glob too) or a
# bare path, from the page's folder, the repository, docs/results/ or the folder of a path named
# before it. Each figure must be a number one of them holds (`_held`), or a ratio or signed
# difference of two figures of its own sentence. Or it is history: the sentence, its paragraph's
# opening sentence, its table's introducing sentence or its section's heading says "history".

UNITS = {"ms": "ms", "s": "s", "sec": "s", "min": "min", "minute": "min", "minutes": "min", "h": "h",
         "hours": "h", "hour": "h", "%": "%", "×": "×", "x": "×", "GiB": "B", "GB": "B", "MiB": "B", "MB": "B",
         "KiB": "B", "KB": "B", "kB": "B", "tokens/s": "", "steps/min": "", "groups/s": "", "groups/min": "",
         "Mbit/s": "", "points": ""}
_NUM = r"[-−+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-−+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
FIGURE = re.compile(rf"(?<![\w.−-])(?P<a>{_NUM})(?:\s?(?:–|-|to)\s?(?P<b>{_NUM}))?"
                    rf"(?:(?P<attached>[×x%])(?![\w\d])|\s?(?P<unit>%|ms|sec|min(?:utes?)?|hours?|h|s|GiB|GB|MiB"
                    rf"|MB|KiB|KB|kB|tokens/s|steps/min|groups/s|groups/min|Mbit/s|points)(?![\w/]))")
COMPOUND = re.compile(r"(?<![\w.])(\d+) (h|min) (\d+)(?: (min|s))?(?![\w/])")
CHANGE = re.compile(rf"(?<![\w.])({_NUM})\s?(?:->|→)\s?\**({_NUM})")
_SAYS_MEASURED = (r"took|measured|ran|reached|ended|gave|went|rose|fell|spent|lasted|finished|peaked|averaged|grew"
                  r"|2-core|EPYC|Xeon|H200|H100|NVIDIA")
MEASURED = re.compile(rf"\b(?:{_SAYS_MEASURED}|dropped|lost|were|was)\b")
STRONGLY_MEASURED = re.compile(rf"\b(?:{_SAYS_MEASURED})\b")  # a table's introduction: not a mere "was"
# a figure that is set, aimed at or computed, not measured: "target 278 s", "the 5 s bound",
# "(budget 10 min)", "within 5 s", "until 20 %", "20 % or less", "a 95 % interval",
# "151,936 × 896 × 2 bytes = 272 MB"
_SET = r"(?:target|bound|budget|bar|limit|timeout|deadline|default|threshold)s?"
STATED_BEFORE = re.compile(rf"(?:\b(?:{_SET}|within|until)\b[:=]?|=)\s*"
                           rf"(?:(?:of|is|the|at|under|over|below|above|[≥≤<>])\s*)*$")
STATED_AFTER = re.compile(rf"\s*[(,]?\s*(?:by |the |a )?(?:'s\s*)?{_SET}\b|\s*(?:or (?:less|more)|interval)\b")
# a results table's header names a measure (or says measured, or its introduction does)
RESULT_COLUMN = re.compile(r"accuracy|held-out|sampled|greedy|median|\bmean\b|\bp50|\bp9[059]|\bmax\b|utilization|"
                           r"staleness|\bKL\b|steps/min|groups/s|per (?:second|minute)|seconds|minutes|s/step|"
                           r"dropped|groups used|\blost\b|ratio|peak|\btime\b|\bMB\b|GiB|%|×|\bms\b|\(s\)|, s\b|"
                           r"degradation|\bgap\b", re.IGNORECASE)
DERIVED = re.compile(r"\b(?:the table computes|computed from)\b", re.IGNORECASE)
HISTORY = re.compile(r"\bhistory\b|history\.md", re.IGNORECASE)
PATHLIKE = re.compile(r"(?<![\w/.:-])((?:\.\./|\./)*[\w.-]+(?:/[\w.-]+)*(?:/|\.(?:json|jsonl|txt|md|yaml|csv|png)))"
                      r"(?![\w/])")
# a results table's columns that say what ran ("model": "tiny, 0.23 M") rather than what it measured
DESCRIBING = re.compile(r"(?:model|config|command|run|what ran|regime|setting)$", re.IGNORECASE)
COLUMN_UNIT = re.compile(r"(?<![\w/])(ms|s|min|%|GiB|GB|MiB|MB|KB)(?=$|[\s/,)])")  # "Redis p99 ms", "KB/sampler"
SENTENCE_END = re.compile(r"(?<=[.!?])(?:\*\*)?\s+(?=[A-Z`(*\[])")  # "**A bold sentence.** The next"


# the machine a figure ran on is not a figure: "a 2-core VM with 24 GiB", "(139.8 GiB, 16 cores,
# 64 GiB disk", "(AMD EPYC, AVX2; 24 GiB, no swap)"
MACHINE = re.compile(r"(?<=with )\d+ GiB\b|\d+(?:\.\d+)? GiB(?=,? (?:\d+ (?:CPU )?cores|no swap|no GPU|disk))")


def _plain(text: str) -> str:
    """The text of a sentence without what is not prose: code spans, link targets, HTML comments,
    the machine's memory."""
    text = MACHINE.sub("", re.sub(r"<!--.*?-->", "", text, flags=re.S))
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"`[^`]*`", "", text)


def _figures(sentence: str, header: str | None = None) -> list[tuple[str, str]]:
    """(number as written without separators, its unit's family) for each figure in `sentence`;
    for a results table's row (`header` given), every number outside its first cell and the
    columns that describe what ran or say they are computed, in the unit its column names
    ("Redis p99 ms") where it has none of its own."""
    text = _plain(sentence)
    if header is not None:
        cells, names = text.strip().strip("|").split(" | "), _plain(header).strip().strip("|").split(" | ")
        found = []
        for cell, name in zip(cells[1:], names[1:] + [""] * len(cells)):
            if DESCRIBING.match(name.strip()) or "computed" in name:  # what ran, or not measured
                continue
            unit = COLUMN_UNIT.search(name)
            # the numbers without a unit, but for what the cell computes ("1.4 + 52.8 + ... = 72.2")
            rest = re.sub(r"=\s*[-−+]?[\d.,]+", " ", FIGURE.sub(" ", COMPOUND.sub(" ", cell)))
            found += _figures(cell) + [(n, UNITS[unit[1]] if unit else "") for n in _numbers(rest)]
        return found
    found = []
    for m in COMPOUND.finditer(text):  # 35 min 16 s, 3 h 20 min: one figure, in the smaller unit
        big, small = float(m[1]), float(m[3])
        found.append((str(int(big * 60 + small)), "s" if m[2] == "min" else "min"))
    text = COMPOUND.sub(" ", text)
    for m in FIGURE.finditer(text):
        if (STATED_BEFORE.search(text, 0, m.start()) or STATED_AFTER.match(text, m.end())
                or text[:m.start()].rstrip().endswith("±")):  # "20 ± 10 ms": a spread, set
            continue
        unit = UNITS[m["attached"] or ("minutes" if (m["unit"] or "").startswith("min") else m["unit"])]
        for n in (m["a"], m["b"]):
            if n:
                found.append((n.replace(",", "").replace("−", "-"), unit))
    for m in CHANGE.finditer(text):
        found += [(n.replace(",", "").replace("−", "-"), "") for n in (m[1], m[2])]
    return found


def _named_files(context: str, page: Path) -> list[Path]:
    """The committed files `context` names, as evidence (see `_evidence_files`): a link, a
    `path` (a glob too) or a bare path, from the page's folder, the repository, docs/results/ or
    the folder of a path named before it (`docs/results/chaos_15min/audit.json` and `schedule.json`)."""
    targets = LINK.findall(context) + re.findall(r"`([^`\s]+)`", context) + PATHLIKE.findall(_plain(context))
    bases, named = [page.parent, ROOT, RESULTS], []
    for target in targets:
        target = target.rstrip(".,;:)")
        if target.startswith(("http://", "https://", "-")):
            continue
        bare = "/" not in target and "." not in target  # `gepo-d0-s2`: only beside a path named before it
        for base in bases[3:] if bare else bases:
            globbed = "*" in target and not target.startswith("/")
            paths = sorted(base.glob(target)) if globbed else [(base / target).resolve()]
            paths = [p for p in paths if p.exists() and ROOT in p.resolve().parents and p != page]
            if paths:
                named += [f for p in paths for f in _evidence_files(p) if _machine_written(f)]
                bases += [paths[0], paths[0].parent] if paths[0].is_dir() else [paths[0].parent]
                break
    return list(dict.fromkeys(named))


def _blocks(text: str) -> list[list[str]]:
    """A page's paragraphs, list items and tables (lists of lines), without code blocks."""
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            current and blocks.append(current)
            current = []
            continue
        stripped = line.strip()
        item = re.match(r"\s*(?:[-*]|\d+\.)\s", line)
        is_row = stripped.startswith("|")
        if fenced or (line.startswith("    ") and not current and not is_row):
            continue
        kind_changes = current and (current[-1].startswith("|") != is_row or current[-1].startswith("#"))
        if not stripped or item or stripped.startswith("#") or kind_changes:
            current and blocks.append(current)
            current = []
        if stripped:
            current.append(stripped)
    current and blocks.append(current)
    return blocks


def _lead_in(blocks: list[list[str]], i: int) -> str:
    """For a list item, the paragraph that introduces its list when it ends with a colon
    ("Measured with `heterorl wan` ... ([results/wan/](...)):"), else ''."""
    is_item = lambda block: re.match(r"(?:[-*]|\d+\.)\s", block[0])  # noqa: E731
    if not is_item(blocks[i]):
        return ""
    while i > 0 and is_item(blocks[i - 1]):
        i -= 1
    lead = " ".join(blocks[i - 1]) if i > 0 else ""
    return lead if lead.endswith(":") and not lead.startswith(("|", "#")) else ""


def _says_measured(text: str) -> bool:
    """Whether `text` states something as measured (not in a condition: "exits 1 if a rollout
    was lost")."""
    return bool(MEASURED.search(re.sub(r"\b(?:if|unless|whether)\b[^,;.()]*", "", _plain(text))))


def _results_sentences(text: str, every_figure: bool = False):
    """(sentence or table row, what may label it history, what may name its evidence, its
    figures) for each results sentence of a page's text (see the rule above); with
    `every_figure` (a page under docs/results/), every sentence with a figure."""
    blocks, section = _blocks(text), ""
    for i, block in enumerate(blocks):
        if block[0].startswith("#"):
            section = block[0]  # a section whose heading says history is history throughout
            continue
        if block[0].startswith("|"):
            j = i  # a table right after a table shares its introduction
            while j > 0 and blocks[j - 1][0].startswith("|"):
                j -= 1
            intro = " ".join(blocks[j - 1]) if j > 0 and not blocks[j - 1][0].startswith("#") else ""
            following = " ".join(blocks[i + 1]) if i + 1 < len(blocks) else ""
            caption = following if following.startswith("(") else ""  # "([probe.txt](probe.txt); ...)"
            header = block[0]
            introduces = SENTENCE_END.split(intro)[-1]  # the sentence that leads into the table
            # a table computed from measured figures (a projection to other models, medians over
            # ranges of steps of a named file) is not measured itself; the intro's figures are checked
            if DERIVED.search(intro) or "computed" in header:
                continue
            results_table = bool(RESULT_COLUMN.search(_plain(header)) or _says_measured(header)
                                 or STRONGLY_MEASURED.search(_plain(introduces)))
            for row in block[2:]:
                around = f"{row}\n{header}\n{intro}\n{caption}\n{section}"
                if results_table:
                    if _figures(row, header):
                        yield row, f"{row}\n{header}\n{introduces}\n{section}", around, _figures(row, header)
                    continue
                for cell in row.strip("|").split(" | "):
                    for sentence in SENTENCE_END.split(cell):
                        if _figures(sentence) and (every_figure or _says_measured(sentence)):
                            yield (sentence, f"{sentence}\n{header}\n{introduces}\n{section}", around,
                                   _figures(sentence))
            continue
        paragraph = " ".join(block)
        sentences = SENTENCE_END.split(paragraph)
        for sentence in sentences:
            if _figures(sentence) and (every_figure or _says_measured(sentence)):
                yield (sentence, f"{sentences[0]}\n{sentence}\n{section}",
                       f"{paragraph}\n{_lead_in(blocks, i)}\n{section}", _figures(sentence))


def _half(n: str) -> float:
    """Half a unit in the last digit `n` shows: how far its rounding may have moved it."""
    return 0.5 * 10.0 ** -(len(n.split(".")[1]) if "." in n else 0)


def _shown(claimed: str, sentence: str) -> list[str]:
    """The other numbers a sentence shows, but for exponents' (1.2e-7 is not an operand)."""
    return [n for n in dict.fromkeys(_numbers(_plain(sentence)))
            if n.lstrip("+") != claimed.lstrip("+") and "e" not in n]


def _quotient_of(claimed: str, sentence: str) -> bool:
    """Whether a ratio is the quotient of two figures its own sentence gives ("1.23× the loop's
    minutes (9.2 against 7.5)"), within their rounding: those are checked themselves."""
    shown = [n for n in _shown(claimed, sentence) if float(n) > 0]
    return any(abs(float(a) / float(b) - float(claimed))
               <= _half(claimed) + float(a) / float(b) * (_half(a) / float(a) + _half(b) / float(b))
               for a in shown for b in shown if a != b)


def _difference_of(claimed: str, sentence: str) -> bool:
    """Whether a signed figure is the difference of two figures its own sentence gives
    ("0.107 -> 0.351 (+0.24)"), within their rounding."""
    shown = _shown(claimed, sentence)
    return any(abs(float(a) - float(b) - float(claimed)) <= _half(claimed) + _half(a) + _half(b)
               for a in shown for b in shown if a != b)


def _derived(claimed: str, unit: str, sentence: str) -> bool:
    """A ratio its sentence computes from two of its figures, or a signed difference of two."""
    return ((unit == "×" and _quotient_of(claimed, sentence))
            or (claimed[0] in "+-" and _difference_of(claimed, sentence)))


def _unsupported(page: Path) -> list[str]:
    """The results sentences of `page` that neither rest on a named file holding their figures
    nor say they are history. A generated report's analysis, below the report, reads the
    report's folder (the report and its cells) without naming it."""
    problems = []
    beside = [f for f in _evidence_files(page.parent) if _machine_written(f)] if _is_generated(page) else []
    every_figure = RESULTS in page.parents
    for sentence, label, context, figures in _results_sentences(_written_by_hand(page), every_figure):
        if HISTORY.search(label) or (DERIVED.search(_plain(sentence)) and _named_files(sentence, page)):
            continue  # history, or a figure its sentence says it computed from a file it names
        files = _named_files(context, page) + beside
        if not files:
            problems.append(f"{page.relative_to(ROOT)}: names no file: {sentence[:160]}")
            continue
        missing = [n for n, unit in figures if not _held(n, files, unit) and not _derived(n, unit, sentence)]
        if missing:
            problems.append(f"{page.relative_to(ROOT)}: {missing} in none of "
                            f"{sorted({str(f.relative_to(ROOT)) for f in files})[:4]}: {sentence[:160]}")
    return problems


def checked_pages() -> list[Path]:
    """README and every page under docs/ but the history notebook, whose every line is history."""
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md")) if p != RESULTS / "history.md")]


def test_every_figure_in_the_docs_rests_on_a_committed_file_that_holds_it_or_is_history():
    """Every page under docs/ and README: a sentence or table row that states a measured figure
    names a committed file a command wrote that holds it, or says it is history."""
    problems = [problem for page in checked_pages() for problem in _unsupported(page)]
    assert problems == [], f"{len(problems)} figures without their file:\n" + "\n".join(problems)


def test_every_result_in_readme_rests_on_a_committed_file_that_holds_its_numbers():
    """Each row of README's Results table names at least one committed file, and every number
    the row claims is one of those files' numbers as written (the same value at the claim's
    precision): a row cannot drift from the run it reports."""
    text = (ROOT / "README.md").read_text()
    table = text.split("\n## Results\n", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| what", "|---"))]
    assert len(rows) >= 10
    for row in rows:
        what, result, evidence = [cell.strip() for cell in row.strip("|").split(" | ")]
        links = LINK.findall(evidence)
        assert links and all((ROOT / link).exists() for link in links), row
        if "below" in result:
            continue
        files = [f for link in links for f in _evidence_files(ROOT / link)]
        result = re.sub(r"\([^)]*heterorl[^)]*\)", "", result)
        missing = [n for n, unit in _figures(f"| {what} | {result} |", header="| what | result |")
                   if not _held(n, files, unit) and not _derived(n, unit, result)]
        assert missing == [], f"{what}: {missing} are in none of {links}"
