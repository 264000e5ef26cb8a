"""tests/durations.json from a whole run's JUnit report: seconds per test module (set-up, call and tear-down
summed), which the xdist scheduling in conftest.py reads to start the longest modules first.

    python -m pytest -n 2 --dist loadgroup --junitxml=/tmp/suite.xml   (what `make test-durations` runs)
    python -m tests.durations /tmp/suite.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def module_seconds(junit_xml: Path) -> dict[str, float]:
    """{"tests/test_x.py": seconds}: each test case's time (pytest's junit `time` is its three phases)
    summed by the module its class name names."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        if module[0] != "tests" or len(module) < 2:
            raise ValueError(f"{junit_xml}: test case {case.get('name')!r} has class name "
                             f"{case.get('classname')!r}, not tests.<module>[.<class>]")
        seconds[f"tests/{module[1]}.py"] += float(case.get("time", 0))
    if not seconds:
        raise ValueError(f"{junit_xml}: no test cases")
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = module_seconds(Path(argv[0]))
    temp = DURATIONS.with_name(DURATIONS.name + ".tmp")
    temp.write_text(json.dumps(table, indent=1) + "\n")
    temp.replace(DURATIONS)
    print(f"{DURATIONS}: {len(table)} modules, {sum(table.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
