"""Check the demo output the README quotes against a log of the demo that just ran (CI runs it after
``scripts/demo.sh``): every quoted line must be a line of the log once times and rates are set aside
and the log's output folder is written as ``demo_out``, so the README's counts and sizes cannot go stale.

    python scripts/check_readme_demo.py LOG DEMO_OUT
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# a duration or a rate: "37.9 s", "103 tokens/s", "247 rows/s" (not "2.70 tokens/step")
TIMING = re.compile(r"\d[\d,]*(\.\d+)?\s*(s|tokens/s|rows/s)\b")


def quoted_demo(readme: str) -> list[str]:
    """The lines of the README's first ``text`` block (the demo's output), less its ``...`` cuts."""
    block = re.search(r"^```text\n(.*?)^```", readme, re.M | re.S)
    if block is None:
        raise SystemExit("README.md has no ```text block with the demo's output")
    return [line for line in block.group(1).splitlines() if line.strip() and line.strip() != "..."]


def normal(line: str, out_dir: str) -> str:
    return TIMING.sub("<time>", line.replace(out_dir.rstrip("/"), "demo_out")).rstrip()


def main(log_path: str, out_dir: str) -> int:
    log = {normal(line, out_dir) for line in Path(log_path).read_text().splitlines()}
    missing = [line for line in quoted_demo(README.read_text()) if normal(line, "demo_out") not in log]
    for line in missing:
        print(f"README.md quotes a demo line the demo did not print (times aside): {line!r}")
    if missing:
        print(f"update README.md's demo output from {log_path}")
        return 1
    print(f"README.md's demo output: {len(quoted_demo(README.read_text()))} quoted lines, all printed by the demo")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
