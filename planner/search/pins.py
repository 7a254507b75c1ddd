"""Pins: the part of the layout a user must keep (``autopar plan --fix "tp=8,pp=1"``).

A pin string is comma-separated items ``key=value``, ``key<=value`` or ``key>=value``:

- degrees ``dp``, ``pp``, ``cp``, ``tp`` and ``ep``, ``mbs``, ``vpp``: a positive integer,
  pinned (``=``) or bounded (``<=``, ``>=``); ``world``, the processes of the layout
  (dp x pp x cp x tp: on a local CPU cluster the search also weighs fewer processes with
  more threads each; ``auto_parallelize`` pins it to the job's processes);
- ``schedule`` (applies when pp > 1), ``zero`` (applies when dp * cp > 1), ``recompute``,
  ``sp`` (on/off) and ``attention`` (flash/eager; unpinned, planner/search/kernel_choice.py
  chooses): pinned with ``=`` only.

The search (planner/search/space.py) tries only what the pins admit; ``zero=zero2`` and
``vpp`` values the search does not try by default are tried when pinned. Bad input is
one line naming the problem and the fix.
"""
from __future__ import annotations

import difflib
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from planner.errors import AutoparError
from planner.plan import RECOMPUTE, SCHEDULES, ParallelConfig
from planner.sharding import ZERO

DEGREES = ("dp", "pp", "cp", "tp")
INT_KEYS = DEGREES + ("ep", "ulysses", "mbs", "vpp", "seq_chunks", "world")  # ep, ulysses: within dp x cp x tp / cp (not mesh degrees)
CHOICES: dict[str, tuple[str, ...]] = {"schedule": SCHEDULES, "zero": ZERO, "recompute": RECOMPUTE,
                                       "sp": ("on", "off"), "attention": ("flash", "eager")}
OPERATORS = ("=", "<=", ">=")
_ITEM = re.compile(r"\s*([A-Za-z_]\w*)\s*([^\w\s.-]*)\s*(.*?)\s*")
_EXAMPLE = 'e.g. --fix "tp=8,pp=1" or --fix "tp<=4,zero=fsdp"'


@dataclass(frozen=True)
class Pins:
    """Inclusive integer bounds per key (``lo``, ``hi``; missing = unbounded) and pinned
    choices (``choice``: key -> value, ``sp`` as ``on``/``off``)."""
    lo: dict[str, int] = field(default_factory=dict)
    hi: dict[str, int] = field(default_factory=dict)
    choice: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.lo or self.hi or self.choice)

    @staticmethod
    def parse(text: str | None) -> "Pins":
        """Parse a pin string (module docstring); None or "" pins nothing."""
        if text is None or not text.strip():
            return Pins()
        lo: dict[str, int] = {}
        hi: dict[str, int] = {}
        choice: dict[str, str] = {}
        for item in (x for x in text.split(",") if x.strip()):
            key, op, value = _split_item(item)
            if key in CHOICES:
                _add_choice(choice, key, op, value, item)
            else:
                n = _positive_int(key, value, item)
                if op in ("=", "<="):
                    hi[key] = min(hi.get(key, n), n)
                if op in ("=", ">="):
                    lo[key] = max(lo.get(key, n), n)
                if lo.get(key, 1) > hi.get(key, math.inf):
                    raise AutoparError(f"--fix {item.strip()!r} contradicts the earlier {key} pin: "
                                       f"keep one value or range of {key}")
        pins = Pins(lo, hi, choice)
        pins._check_combinations()
        return pins

    def _check_combinations(self) -> None:
        if self.choice.get("sp") == "on" and self.hi.get("tp", 2) < 2:
            raise AutoparError("--fix sp=on needs tp > 1 (sequence parallel shards along tp): drop sp=on or allow tp>=2")
        if self.lo.get("vpp", 1) > 1 and self.choice.get("schedule", "interleaved-1f1b") != "interleaved-1f1b":
            raise AutoparError(f"--fix vpp>={self.lo['vpp']} needs schedule=interleaved-1f1b, not "
                               f"{self.choice['schedule']}: drop one of them")
        if self.lo.get("vpp", 1) > 1 and self.hi.get("pp", 2) < 2:
            raise AutoparError("--fix vpp > 1 needs a pipeline: allow pp>=2 or drop the vpp pin")

    def check_world(self, world: int, where: str = "") -> "Pins":
        """``self`` if some dp x pp x cp x tp = ``world`` satisfies the degree pins, else a
        one-line error naming the pin (``where``: the cluster's name, for the message)."""
        on = f"the {world} devices{f' of {where}' if where else ''}"
        divs = [d for d in range(1, world + 1) if world % d == 0]
        options = {}
        for k in DEGREES:
            options[k] = [d for d in divs if self.allows(k, d)]
            if not options[k]:
                if self.lo.get(k) == self.hi.get(k):
                    raise AutoparError(f"--fix {k}={self.lo[k]} does not divide {on}: pin a divisor of {world} "
                                       f"({', '.join(map(str, divs))})")
                raise AutoparError(f"--fix {self.describe(k)}: no divisor of {on} is in range: allow one of "
                                   f"{', '.join(map(str, divs))}")
        fixed = {k: v[0] for k, v in options.items() if len(v) == 1 and v[0] > 1}
        if world % math.prod(fixed.values()):
            raise AutoparError(f"--fix {' x '.join(f'{k}={v}' for k, v in fixed.items())} = "
                               f"{math.prod(fixed.values())} does not divide {on}: loosen one of them")
        if not any(math.prod(c) == world for c in itertools.product(*options.values())):
            raise AutoparError(f"--fix {self.to_str()}: no dp x pp x cp x tp = {world} ({on}) satisfies the pins "
                               "together: loosen one")
        return self

    def allows(self, key: str, value: Any) -> bool:
        """Whether ``key`` may take ``value`` (``sp`` as a bool or on/off)."""
        if key in CHOICES:
            if key not in self.choice:
                return True
            v = ("on" if value else "off") if isinstance(value, bool) else value
            return v == self.choice[key]
        return self.lo.get(key, 1) <= value <= self.hi.get(key, math.inf)

    def admits(self, cfg: ParallelConfig) -> bool:
        return not self.violations(cfg)

    def violations(self, cfg: ParallelConfig) -> list[str]:
        """Each pin ``cfg`` breaks, as ``"pin (the configuration has key=value)"``."""
        return [f"{pin} (the configuration has {why})" for pin, why in self.check(cfg) if why]

    def check(self, cfg: ParallelConfig) -> list[tuple[str, str | None]]:
        """Per pinned key: (its pins, None if ``cfg`` satisfies them else ``cfg``'s ``key=value``).
        Schedule and vpp pins hold trivially without a pipeline, zero pins without dp * cp > 1."""
        out: list[tuple[str, str | None]] = []
        for key in self.keys():
            value = getattr(cfg, key)
            moot = (key in ("schedule", "vpp") and cfg.pp == 1) or (key == "zero" and cfg.dp * cfg.cp == 1)
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            out.append((self.describe(key), None if moot or self.allows(key, value) else f"{key}={shown}"))
        return out

    def keys(self) -> list[str]:
        """The pinned keys, in the canonical order."""
        return [k for k in INT_KEYS + tuple(CHOICES) if k in self.lo or k in self.hi or k in self.choice]

    def describe(self, key: str) -> str:
        """The pins of one key: ``tp=8``, ``tp>=2,tp<=4``, ``zero=fsdp``."""
        if key in self.choice:
            return f"{key}={self.choice[key]}"
        lo, hi = self.lo.get(key), self.hi.get(key)
        if lo is not None and lo == hi:
            return f"{key}={lo}"
        return ",".join(x for x in (f"{key}>={lo}" if lo is not None else "",
                                    f"{key}<={hi}" if hi is not None else "") if x)

    def to_str(self) -> str:
        """The canonical pin string (what ``parse`` reads back), e.g. ``pp=1,tp<=4``."""
        return ",".join(self.describe(k) for k in self.keys())


def as_pins(fix: "Pins | str | None") -> Pins:
    """A ``Pins`` from a pin string, ``Pins`` or None."""
    return fix if isinstance(fix, Pins) else Pins.parse(fix)


def _split_item(item: str) -> tuple[str, str, str]:
    m = _ITEM.fullmatch(item)
    if not m or not m.group(2) or not m.group(3):
        raise AutoparError(f"bad --fix item {item.strip()!r}: write key=value, key<=value or key>=value, {_EXAMPLE}")
    key, op, value = m.group(1), m.group(2), m.group(3)
    if key not in INT_KEYS and key not in CHOICES:
        close = difflib.get_close_matches(key, INT_KEYS + tuple(CHOICES), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise AutoparError(f"unknown --fix key {key!r}{hint}: use {', '.join(INT_KEYS + tuple(CHOICES))}")
    op = "=" if op == "==" else op
    if op not in OPERATORS:
        raise AutoparError(f"bad --fix operator {op!r} in {item.strip()!r}: use =, <= or >=, e.g. {key}<=4")
    return key, op, value


def _positive_int(key: str, value: str, item: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise AutoparError(f"--fix {item.strip()!r}: {key} takes a positive integer, e.g. {key}=4")
    return n


def _add_choice(choice: dict[str, str], key: str, op: str, value: str, item: str) -> None:
    if op != "=":
        raise AutoparError(f"--fix {item.strip()!r}: {key} can only be pinned with =, e.g. {key}={CHOICES[key][-1]}")
    v = {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off"}.get(value.lower(), value) \
        if key == "sp" else value
    if v not in CHOICES[key]:
        raise AutoparError(f"--fix {key}={value}: choose one of {', '.join(CHOICES[key])}")
    if choice.get(key, v) != v:
        raise AutoparError(f"--fix {key}={choice[key]} and {key}={v} contradict: keep one")
    choice[key] = v
