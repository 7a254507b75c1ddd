"""First run on this machine: `autopar demo` with an empty calibration cache, then again with it.

    python -m benchmarks.first_run [--out benchmarks/results/first_run.json]

Each demo runs in a fresh process (as a user's would) with ``AUTOPAR_CACHE_DIR`` pointing at a
new folder, so the first one profiles the machine; the second reuses the cache. Prints per run
the wall time, the plan, predicted and measured step time (and their ratio), the one-process
step time and speedup (``x=``: the demo called it a tie, the plan's median step within the
one-process steps' middle half), the loss at the first and last step, and writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

PATTERNS = {
    "plan": r"^plan: (.+) \((?:un)?calibrated\)$",
    "predicted_s": r"^step time: predicted ([\d.]+) s",
    "measured_s": r"measured ([\d.]+) s \(measured/predicted",
    "ratio": r"measured/predicted ([\d.]+)\)",
    "single_process_s": r"^one process: ([\d.]+) s/step",
    "speedup": r"speedup ([\d.]+)x",
    "first_loss": r"^loss: ([\d.]+) at the first step",
    "last_loss": r"-> ([\d.]+) at the last",
    "entropy_floor": r"entropy floor: ([\d.]+)\)",
}


def parse_summary(text: str) -> dict:
    """The demo's closing lines as numbers (a missing line is None)."""
    out: dict = {}
    for key, pat in PATTERNS.items():
        m = re.search(pat, text, re.M)
        out[key] = (m.group(1) if key == "plan" else float(m.group(1))) if m else None
    out["calibrated"] = bool(re.search(r"^plan: .+ \(calibrated\)$", text, re.M))
    out["tie"] = "(a tie: within the one-process steps' middle half" in text
    return out


def run_demo(cache: str, run_dir: str) -> dict:
    env = dict(os.environ, AUTOPAR_CACHE_DIR=cache, AUTOPAR_CALIBRATE="1")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "planner.entry.cli", "demo", "--dir", run_dir], capture_output=True,
                       text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"autopar demo failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return dict(parse_summary(r.stdout), wall_s=round(wall, 1),
                profiled="first plan on this machine: profiling" in r.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/first_run.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="autopar-first-run-") as tmp:
        cache = os.path.join(tmp, "cache")
        rows = [dict(run_demo(cache, os.path.join(tmp, f"demo{i}")), run=("first (profiles)", "second (cached)")[i])
                for i in range(2)]
    print(f"{'run':<18}{'wall s':>8}  {'plan':<28}{'pred s':>8}{'meas s':>8}{'ratio':>7}{'1-proc s':>9}"
          f"{'speedup':>8}{'loss first -> last':>22}")
    for r in rows:
        print(f"{r['run']:<18}{r['wall_s']:>8.1f}  {r['plan'] or '?':<28}{r['predicted_s']:>8.3f}{r['measured_s']:>8.3f}"
              f"{r['ratio']:>7.2f}{r['single_process_s']:>9.3f}{r['speedup']:>7.2f}{'x=' if r['tie'] else 'x '}"
              f"{r['first_loss']:>12.3f} -> {r['last_loss']:.3f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"runs": rows, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
