"""Print the README's family-coverage table from the parity tests' own list (tests/families.py COVERAGE).

    .venv/bin/python scripts/family_coverage.py            # print the table
    .venv/bin/python scripts/family_coverage.py --write    # replace the README's section with it

``tests/test_family_coverage.py`` runs parity for every entry and asserts that the README's section equals this
output, so the table cannot drift from what is tested.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- family-coverage:start -->", "<!-- family-coverage:end -->"


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from families import coverage_table

    table = coverage_table()
    if "--write" not in argv:
        print(table, end="")
        return 0
    readme = ROOT / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        print(f"README.md has no {START} … {END} section", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{START}\n{table}{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
