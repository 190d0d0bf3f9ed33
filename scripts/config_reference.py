"""Write docs/config.md, the configuration reference, from the config schema (regen/config/).

    python scripts/config_reference.py           # (re)write docs/config.md
    python scripts/config_reference.py --check   # exit 1 when docs/config.md differs from the schema

Run it after changing a config field, its default or its description; tests/test_docs.py runs
--check, so a stale page fails the tests."""

import argparse
import sys
from pathlib import Path

from regen.config.reference import markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when the page is stale")
    args = p.parse_args()
    text = markdown()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(PAGE.parents[1])} is stale: run python scripts/config_reference.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
