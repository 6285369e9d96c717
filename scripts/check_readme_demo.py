"""Check the demo output the README quotes against a log of the demo that just ran (CI runs it after
``scripts/demo.sh``): every quoted line must be a line of the log once times and rates are set aside
and the log's output folder is written as ``demo_out``, so the README's counts and sizes cannot go stale.

The demo trains its models on the CPU in float32, and the weights, hence the losses, accept lengths,
sizes and errors the demo prints, depend on the matrix kernels the CPU's vector units select (the
same on every run of one kind of CPU; an AMD CPU with AVX2 and an Intel one with AMX train
different demo models). The README names the kind of CPU its output comes from (``CPU: ...``); on
another kind every figure is set aside too, and only the lines' words and shapes are compared.

    python scripts/check_readme_demo.py LOG DEMO_OUT
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# a duration or a rate: "37.9 s", "103 tokens/s", "247 rows/s" (not "2.70 tokens/step")
TIMING = re.compile(r"\d[\d,]*(\.\d+)?\s*(s|tokens/s|rows/s)\b")
FIGURE = re.compile(r"\d[\d,]*(\.\d+)?")
CPU_NOTE = re.compile(r"CPU: ([^)]+)\)")  # "(..., CPU: AMD with AVX2)" in the sentence before the block


def this_cpu() -> str:
    """The kind of CPU, as far as the float kernels go: its vendor and its widest vector unit."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.M)
    flag_line = re.search(r"^flags\s*:(.*)$", info, re.M)
    flags = set(flag_line.group(1).split()) if flag_line else set()
    unit = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                 if flag in flags), "no AVX2")
    maker = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor.group(1) if vendor else "", "unknown")
    return f"{maker} with {unit}"


def quoted_demo(readme: str) -> list[str]:
    """The lines of the README's first ``text`` block (the demo's output), less its ``...`` cuts."""
    block = re.search(r"^```text\n(.*?)^```", readme, re.M | re.S)
    if block is None:
        raise SystemExit("README.md has no ```text block with the demo's output")
    return [line for line in block.group(1).splitlines() if line.strip() and line.strip() != "..."]


def quoted_cpu(readme: str) -> str | None:
    """The kind of CPU the README says its demo output comes from."""
    before = readme[:readme.index("```text")].rstrip().rsplit("\n\n", 1)[-1]  # the paragraph leading to the block
    found = CPU_NOTE.search(" ".join(before.split()))
    return found.group(1).strip() if found else None


def normal(line: str, out_dir: str, figures: bool = True) -> str:
    line = TIMING.sub("<time>", line.replace(out_dir.rstrip("/"), "demo_out")).rstrip()
    return line if figures else FIGURE.sub("<n>", line)


def main(log_path: str, out_dir: str, cpu: str | None = None) -> int:
    readme = README.read_text()
    cpu, theirs = cpu or this_cpu(), quoted_cpu(readme)
    figures = theirs == cpu
    if not figures:
        print(f"this machine's CPU ({cpu}) is not the one the README's demo output comes from "
              f"({theirs}): it trains other demo models, so figures are set aside too")
    log = {normal(line, out_dir, figures) for line in Path(log_path).read_text().splitlines()}
    quoted = quoted_demo(readme)
    missing = [line for line in quoted if normal(line, "demo_out", figures) not in log]
    for line in missing:
        print(f"README.md quotes a demo line the demo did not print ({'times' if figures else 'figures'} aside): "
              f"{line!r}")
    if missing:
        print(f"update README.md's demo output from {log_path}" + ("" if figures else f" (and its CPU: {cpu})"))
        return 1
    print(f"README.md's demo output: {len(quoted)} quoted lines, all printed by the demo"
          + ("" if figures else " (figures aside)"))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
