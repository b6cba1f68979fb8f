"""Rewrite the table of docs/compatibility.md from the declared capabilities (visionpe.contract.compatibility_table).

python scripts/compatibility_table.py            # rewrite the table in place
python scripts/compatibility_table.py --check    # exit 1 if the page's table is not the generated one
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import visionpe  # noqa: F401  (registers the schemes and the model entry points)
from visionpe.contract import compatibility_table
from visionpe.registry import get_scheme_class, registered_schemes

try:  # the clip extra: its entry point registers on import
    import visionpe.integrations.open_clip  # noqa: F401
except ImportError:
    pass

PAGE = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
START, END = "<!-- compatibility table: start -->", "<!-- compatibility table: end -->"


def render(page: str) -> str:
    """``page`` with the text between the table markers replaced by the generated table of visionpe's own schemes
    (not those a program registers for a while, such as the tests' throwaway schemes)."""
    if page.count(START) != 1 or page.count(END) != 1:
        raise ValueError(f"page must hold one {START!r} and one {END!r} line")
    head, rest = page.split(START)
    _, tail = rest.split(END)
    own = [n for n in registered_schemes() if get_scheme_class(n).__module__.startswith("visionpe.")]
    return f"{head}{START}\n\n{compatibility_table(own)}\n\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the table is out of date")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    new = render(page)
    if args.check:
        if new != page:
            print(f"{PAGE.name}: the table is out of date; run python scripts/compatibility_table.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
