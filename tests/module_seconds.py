"""How long each test module takes, for the order in which parallel workers get them (tests/conftest.py): the
longest first, so that no long module starts last while the other worker sits idle (on 2 workers the suite's wall
time is then close to half its total). The table, module_seconds.json, holds the modules of 5 s or more from a
`make test` on 2 cores; a module missing from it counts as 0 s.

Refresh it after a change moves a module's time a lot:
    make test PYTEST_ARGS=--junitxml=/tmp/junit.xml && .venv/bin/python -m tests.module_seconds /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).with_name("module_seconds.json")
MIN_SECONDS = 5.0


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def from_junit(path: Path) -> dict[str, float]:
    """Seconds per module file (setup, call and teardown of its tests) in a pytest junit XML report."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.unit.test_x[.Class]
        module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
        seconds["/".join(parts[: module + 1]) + ".py"] += float(case.get("time", 0))
    return {name: round(s) for name, s in seconds.most_common() if s >= MIN_SECONDS}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {TABLE}")
