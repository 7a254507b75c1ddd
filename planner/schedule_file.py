"""A schedule IR as a file: JSON (ours) and torch's CSV action format, read and written.

CSV (``torch.distributed.pipelining``'s ``_load_csv`` "compute_only" form): one row per pp rank,
one cell per action, ``<stage><kind><micro-batch>`` (``0F0``, ``1B0``, ``2I3``, ``2W3``) or an
overlapped pair ``(0F2;1B0)OVERLAP_F_B``; empty cells are idle slots and are skipped. The
micro-batches are the highest index + 1 and each stage lives on the rank whose row runs it.

JSON::

    {"version": 1, "name": "mine", "microbatches": 4, "stage_ranks": [0, 1],
     "ranks": [["0F0", "0F1", ...], ["1F0", ...]]}

(``microbatches`` and ``stage_ranks`` optional: inferred as for CSV). Reading only parses;
:func:`load` parses and checks (``planner/schedule_check.py``). Every problem is one line naming
the file, the place and the fix.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re

from planner.schedule_check import check
from planner.schedule_ir import Action, Overlap, Schedule, ScheduleError, Step

_ACTION = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")
_OVERLAP = re.compile(r"^\s*\(([^;()]*);([^;()]*)\)\s*OVERLAP_F_B\s*$")
FORMATS = ("json", "csv")


def parse_step(text: str, where: str) -> Step:
    """One cell: an action or an overlapped forward + backward."""
    if (m := _OVERLAP.match(text)):
        f, b = parse_step(m.group(1), where), parse_step(m.group(2), where)
        if not (isinstance(f, Action) and f.kind == "F" and isinstance(b, Action) and b.kind in ("B", "I")):
            raise ScheduleError(f"{where}: {text.strip()!r} must overlap a forward with a backward, e.g. "
                                "(0F2;1B0)OVERLAP_F_B")
        return Overlap(f, b)
    if not (m := _ACTION.match(text)):
        raise ScheduleError(f"{where}: {text.strip()[:40]!r} is not an action; write <stage><F|B|I|W><micro-batch>, "
                            "e.g. 1F0, or (0F2;1B0)OVERLAP_F_B")
    return Action(m.group(2), int(m.group(1)), int(m.group(3)))


def from_rows(rows: list[list[str]], name: str, where: str, m: int | None = None,
              stage_rank: list[int] | None = None, k: int = 1) -> Schedule:
    """A schedule from per-rank lists of cells (blank cells skipped); ``m`` and ``stage_rank``
    inferred when not given; ``k`` sequence chunks per micro-batch (``m`` counts units)."""
    ranks = []
    for r, row in enumerate(rows):
        if not isinstance(row, list):
            raise ScheduleError(f"{where}: rank {r} is not a list of actions")
        steps = []
        for i, cell in enumerate(row):
            if not isinstance(cell, str):
                raise ScheduleError(f"{where}: rank {r} entry {i} is {cell!r}, not an action string like '1F0'")
            if cell.strip():
                steps.append(parse_step(cell, f"{where} rank {r} entry {i}"))
        ranks.append(tuple(steps))
    acts = [(r, a) for r, steps in enumerate(ranks) for st in steps for a in (st.parts if isinstance(st, Overlap) else (st,))]
    if m is None:
        m = 1 + max((a.mb for _, a in acts), default=-1)
    if stage_rank is None:
        n_stages = 1 + max((a.stage for _, a in acts), default=-1)
        placed: dict[int, int] = {}
        for r, a in acts:
            placed.setdefault(a.stage, r)
        if (gap := next((s for s in range(n_stages) if s not in placed), None)) is not None:
            raise ScheduleError(f"{where}: no rank runs stage {gap}; every stage 0..{n_stages - 1} needs its actions")
        stage_rank = [placed[s] for s in range(n_stages)]
    return Schedule(name=name, n_microbatches=m, stage_rank=tuple(stage_rank), ranks=tuple(ranks), seq_chunks=k)


def parse_csv(text: str, name: str = "custom", where: str = "schedule.csv") -> Schedule:
    """A schedule from torch's CSV action format (not checked)."""
    rows = [row for row in csv.reader(io.StringIO(text))]
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError(f"{where}: empty; write one row of actions per pp rank, e.g. 0F0,0B0")
    return from_rows(rows, name, where)


def parse_json(text: str, name: str = "custom", where: str = "schedule.json") -> Schedule:
    """A schedule from our JSON form (not checked)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScheduleError(f"{where}: not JSON ({e.msg} at line {e.lineno}); write the schedule as JSON or CSV")
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), list):
        raise ScheduleError(f"{where}: expected an object with \"ranks\": [[\"0F0\", ...], ...]")
    if doc.get("version", 1) != 1:
        raise ScheduleError(f"{where}: version {doc.get('version')!r}; this autopar reads version 1")
    m, sr, k = doc.get("microbatches"), doc.get("stage_ranks"), doc.get("seq_chunks", 1)
    if m is not None and (isinstance(m, bool) or not isinstance(m, int)):
        raise ScheduleError(f"{where}: microbatches={m!r}; give a positive integer")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ScheduleError(f"{where}: seq_chunks={k!r}; give a positive integer (1: whole sequences)")
    if sr is not None and (not isinstance(sr, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in sr)):
        raise ScheduleError(f"{where}: stage_ranks={sr!r}; give the pp rank of each stage, e.g. [0, 1, 1, 0]")
    return from_rows(doc["ranks"], str(doc.get("name", name)), where, m, sr, k)


def to_json(s: Schedule) -> str:
    """``s`` in the JSON form (``seq_chunks`` only when it cuts sequences: ``microbatches`` then counts
    the (micro-batch, chunk) units)."""
    return json.dumps({"version": 1, "name": s.name, "microbatches": s.n_microbatches,
                       **({"seq_chunks": s.seq_chunks} if s.seq_chunks > 1 else {}),
                       "stage_ranks": list(s.stage_rank), "ranks": [[str(st) for st in steps] for steps in s.ranks]})


def to_csv(s: Schedule) -> str:
    """``s`` in torch's CSV action format."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for steps in s.ranks:
        w.writerow([str(st) for st in steps])
    return buf.getvalue()


def parse(text: str, fmt: str, name: str = "custom", where: str = "schedule") -> Schedule:
    """Parse ``text`` in ``fmt`` (json or csv) and check it."""
    if fmt not in FORMATS:
        raise ScheduleError(f"{where}: unknown schedule format {fmt!r}; use a .json or .csv file")
    s = parse_json(text, name, where) if fmt == "json" else parse_csv(text, name, where)
    return check(s, where=where)


def load(path: str) -> Schedule:
    """Read and check the schedule file ``path`` (.json or .csv)."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in FORMATS:
        raise ScheduleError(f"{path}: a schedule file is .json or .csv (torch's action format), not .{ext or '?'}")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ScheduleError(f"{path}: cannot read ({e.strerror}); check the path")
    return parse(text, ext, os.path.splitext(os.path.basename(path))[0], path)
