"""Shared pieces of every config section: the error type, byte sizes, range checks, dtype names."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any, Iterable, Literal, Union


class ConfigError(ValueError):
    """A configuration problem; the message names the field and what is allowed."""


# How type_text spells an annotation: in an error message's words, or as the field listing's code.
_WORDS = {"literal": ("one of ", ", "), "union": " or ", "list": "a list of {}", "any": "any value",
          "names": {int: "an integer", float: "a number", str: "a string", bool: "true/false", dict: "a mapping"}}
_CODE = {"literal": ("", " | "), "union": " | ", "list": "list[{}]", "any": "any", "names": {}}


def type_text(tp, words: bool = True) -> str:
    """An annotation as an error message says it (``one of 'a', 'b'``, ``an integer or null``) or,
    ``words`` False, as the field listing writes it (``'a' | 'b'``, ``int | null``, ``list[str]``)."""
    spell = _WORDS if words else _CODE
    origin = typing.get_origin(tp)
    if origin is Literal:
        lead, sep = spell["literal"]
        return lead + sep.join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return spell["union"].join(type_text(a, words) for a in typing.get_args(tp))
    if origin is list:
        return spell["list"].format(type_text(typing.get_args(tp)[0], words))
    if tp is type(None):
        return "null"
    if tp is Any:
        return spell["any"]
    return spell["names"].get(tp, getattr(tp, "__name__", str(tp)))


def did_you_mean(name: str, allowed: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the allowed name closest to a misspelt ``name`` (difflib), or ``""``."""
    close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}

def parse_bytes(value: Any, name: str) -> int:
    """Parses ``1073741824``, ``"512MiB"`` or ``"2GB"`` into a byte count."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte size like 4096 or '512MiB', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS:
            return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    raise ConfigError(f"{name}: expected a byte size like 4096 or '512MiB', got {value!r}")


def check_range(name: str, value, *, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    if value is None:
        return
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (
        hi is not None and (value >= hi if hi_open else value > hi)
    )
    if bad:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi}"
        allowed = " and ".join(s for s in (lo_s, hi_s) if s)
        raise ConfigError(f"{name}: must be {allowed}, got {value!r}")


DType = Literal["bfloat16", "float16", "float32"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "offload"]
# How training forwards compute attention: "dense" (the whole T x S scores), "blockwise" (memory
# linear in T), "auto" (blockwise for long rows; see jaxascend.models.blockwise_attention).
AttentionImpl = Literal["auto", "blockwise", "dense"]
# How training and evaluation compute the LM head and the loss: "dense" (the whole [B, T, V] logits),
# "blocked" (blocks of tokens and vocabulary, logits never whole), "auto" (blocked for large B*T*V;
# see jaxascend.models.blocked_loss).
LossImpl = Literal["auto", "blocked", "dense"]
HiddenAct = Literal["silu", "gelu_new", "gelu_pytorch_tanh", "gelu"]
