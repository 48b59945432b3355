"""The deterministic results tables of docs/results.md hold what the code computes today
(``fp4pass.bench.readme``).

Each table is found as the first markdown table after the heading whose text starts with the module's
``*_HEADING``; regenerate with ``python -m fp4pass.bench.readme`` and paste when a method changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fp4pass.bench import readme

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results.md"


def table_under(text: str, heading: str) -> list[list[str]]:
    """Cells of the first markdown table after the heading whose text starts with ``heading`` (header first,
    separator line dropped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("#") and line.lstrip("#").strip().startswith(heading)), None)
    if start is None:
        raise AssertionError(f"no heading starting with {heading!r}")
    table = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    if not table:
        raise AssertionError(f"no table under the heading {heading!r}")
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table]
    return [rows[0]] + [r for r in rows[1:] if not all(set(c) <= set("-: ") for c in r)]


def check(heading: str, header: list[str], rows: list[list[str]]) -> None:
    committed = table_under(RESULTS.read_text(encoding="utf-8"), heading)
    assert committed[0] == header, f"docs/results.md table under {heading!r}: header differs"
    expected = {r[0]: r for r in rows}
    assert [r[0] for r in committed[1:]] == list(expected), f"docs/results.md table under {heading!r}: rows differ"
    for row in committed[1:]:
        assert row == expected[row[0]], (f"docs/results.md table under {heading!r}, row {row[0]!r}: it has {row}, "
                                         f"the code computes {expected[row[0]]}; regenerate with "
                                         "python -m fp4pass.bench.readme")


def test_parser_reads_back_what_the_generator_writes():
    rows = [["a &#124; b", "1", ""], ["c", "2.5e-07", "x"]]
    text = "# T\n\n### Results: here\n\nprose\n\n" + readme.markdown(["n", "v", "w"], rows) + "\n\nafter\n| no |\n"
    assert table_under(text, "Results:") == [["n", "v", "w"], *rows]
    with pytest.raises(AssertionError, match="no heading"):
        table_under(text, "Missing")


def test_main_job_table_matches_the_code():
    check(readme.MAIN_JOB_HEADING, readme.EXAMPLE_HEADER, readme.main_job_rows())


def test_example_model_table_matches_the_code():
    check(readme.EXAMPLE_HEADING, readme.EXAMPLE_HEADER, readme.example_rows())


@pytest.mark.slow
def test_study_table_matches_the_code():
    check(readme.STUDY_HEADING, readme.STUDY_HEADER, readme.study_rows("cpu"))
