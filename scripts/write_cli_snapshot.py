"""Write src/entoscope/cli_snapshot.json from the real parser (`cli.build_parser()`, which imports every
operation), after changing an operation's fields or a command's options; tests/test_startup.py fails
while the file is out of date.

    python scripts/write_cli_snapshot.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

try:
    import entoscope  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from entoscope.cli import build_parser  # noqa: E402
from entoscope.cli_snapshot import PATH, snapshot  # noqa: E402


def main() -> None:
    PATH.write_text(json.dumps(snapshot(build_parser()), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
