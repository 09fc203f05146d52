"""The documentation a newcomer follows: README stays a front door, and no link leads nowhere."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


NUMBER = re.compile(r"(?<![\w.])[-−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "").replace("−", "-") for n in NUMBER.findall(text)]


def _rounds_to(claimed: str, found: float) -> bool:
    """Whether `found` (from an evidence file) is `claimed` as written: the same value at the
    claim's own precision (decimals, or significant digits for 1.2e-7)."""
    value = float(claimed)
    if "e" in claimed:
        mantissa = claimed.split("e")[0]
        digits = len(mantissa.replace("-", "").replace(".", "")) - 1
        return found != 0 and f"{found:.{digits}e}" == f"{value:.{digits}e}"
    decimals = len(claimed.split(".")[1]) if "." in claimed else 0
    return round(found, decimals) == round(value, decimals)


def _evidence_numbers(links: list[str]) -> list[float]:
    found = []
    for link in links:
        path = ROOT / link
        files = [path] if path.is_file() else []
        if path.name == "README.md" or path.is_dir():  # a results folder: every file in it
            files += [f for f in (path if path.is_dir() else path.parent).rglob("*")
                      if f.is_file() and f.suffix in (".json", ".txt", ".md", ".jsonl")]
        for f in files:
            for n in _numbers(f.read_text(errors="replace")):
                try:
                    found.append(float(n))
                except ValueError:
                    pass
    return found


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
        found = _evidence_numbers(links)
        claimed = [n for n in _numbers(re.sub(r"`[^`]*`|\([^)]*heterorl[^)]*\)", "", result))]
        missing = [n for n in claimed if not any(_rounds_to(n, f) for f in found)]
        assert missing == [], f"{what}: {missing} are in none of {links}"
