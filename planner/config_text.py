"""A configuration as a user types it: ``key=value`` pairs, or the label autopar prints.

``autopar evaluate --config`` takes either form: ``dp=8,pp=8,tp=2,sp=on,seq_chunks=4`` (every
field by name: ``ParallelConfig.parse``) or a label copied from a plan's output or its
alternatives table, ``dp8 pp8 cp1 tp2 mbs1 1f1b fsdp sp seq-chunks4`` (``ParallelConfig.label``'s
words, in any order). A label names what it shows; the fields it does not show (the kernels and
the dtype) keep their defaults, and ``config_keys`` says which fields the text gave.
"""
from __future__ import annotations

import re

from planner.errors import PlanError
from planner.plan import RECOMPUTE, RUN_SCHEDULES, ParallelConfig
from planner.sharding import ZERO

_EXAMPLE = "e.g. 'dp=8,pp=8,tp=2' or the label a plan prints, 'dp8 pp8 cp1 tp2 mbs1 1f1b fsdp sp'"


def is_label(text: str) -> bool:
    """Whether ``text`` is a label (words) rather than ``key=value`` pairs."""
    return "=" not in text and bool(text.split())


def parse_config(text: str) -> ParallelConfig:
    """The configuration ``text`` names, in either form (module docstring), validated."""
    if not is_label(text):
        return ParallelConfig.parse(text)
    return ParallelConfig(**_label_fields(text)).validate()


def config_keys(text: str) -> set[str]:
    """The fields ``text`` gives (a label: those its words set)."""
    if is_label(text):
        return set(_label_fields(text))
    return {item.split("=", 1)[0].strip() for item in text.split(",") if "=" in item}


def _label_fields(text: str) -> dict:
    kw: dict = {}
    for word in text.split():
        key, value = _word(word)
        if key in kw:
            raise PlanError(f"--config label {text!r}: {key} given twice ({word!r}); {_EXAMPLE}")
        if isinstance(value, tuple):  # a schedule with its virtual stages: interleaved-1f1b(v2)
            kw["vpp"] = value[1]
            value = value[0]
        kw[key] = value
    return kw


def _word(word: str) -> tuple[str, object]:
    """One label word as (field, value)."""
    if m := re.fullmatch(r"(dp|pp|cp|tp|ep|ulysses|mbs|threads)(\d+)", word):
        return m.group(1), int(m.group(2))
    if m := re.fullmatch(r"([a-z0-9-]+)\(v(\d+)\)", word):  # interleaved-1f1b(v2)
        if m.group(1) not in RUN_SCHEDULES:
            raise PlanError(f"--config label word {word!r}: schedule {m.group(1)!r} is not one of "
                            f"{', '.join(RUN_SCHEDULES)}")
        return "schedule", (m.group(1), int(m.group(2)))
    if word in RUN_SCHEDULES:
        return "schedule", word
    if word in ZERO:
        return "zero", word
    if word.startswith("rc-") and word[3:] in RECOMPUTE:
        return "recompute", word[3:]
    if word == "sp":
        return "sp", True
    if word == "vocab-passes":
        return "vocab_passes", True
    if word == "compiled":
        return "compile", True
    if m := re.fullmatch(r"seq-chunks(\d+)", word):
        return "seq_chunks", int(m.group(1))
    if word.startswith("fp8-"):
        return "fp8", word[4:]
    if word.startswith("low-comm-"):
        return "low_comm", word[len("low-comm-"):]
    if word.startswith("shares"):
        return "dp_shares", word[len("shares"):]
    raise PlanError(f"--config label word {word!r} is not one autopar prints (dpN ppN cpN tpN epN ulyssesN mbsN, "
                    f"a schedule, {'/'.join(ZERO)}, rc-POLICY, sp, seq-chunksN, fp8-RECIPE, compiled, vocab-passes, "
                    f"low-comm-GxH:DTYPE, sharesSxN+..); {_EXAMPLE}")
