"""Which collectives of a compiled XLA program may run at the same time (for the tests).

A collective (all-reduce, reduce-scatter, all-gather, ...) or a loop or branch that holds one is
*ordered* against another when one's input is reachable from the other's output through data
(operands); control edges are not counted, the CPU runtime does not keep them. Within each
computation (the entry, every loop body and branch) every pair must be ordered.
"""

from __future__ import annotations

import re

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute",
               "all-reduce-start", "all-gather-start", "collective-permute-start")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OP = re.compile(r"\s([a-z][a-z\-]*)\(")
_CALLED = re.compile(r"(?:to_apply|body|condition|calls|branch_computations)=\{?([^}\s]*(?:,\s*%[\w.\-]+)*)\}?")


def _parse(text: str) -> dict[str, dict[str, tuple[str, list[str], list[str]]]]:
    """computation -> instruction -> (opcode, operands, called computations)."""
    comps: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("{")[0].split("(")[0]:
            current = comps.setdefault("ENTRY" if line.startswith("ENTRY") else header.group(1), {})
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if current is None or not m:
            continue
        name, rest = m.groups()
        op = _OP.search(" " + rest.split("), ")[0] if "(" in rest else " " + rest)
        opcode = op.group(1) if op else ""
        called = [c.strip().lstrip("%") for group in _CALLED.findall(rest) for c in group.split(",") if c.strip()]
        body = rest.split("control-predecessors=")[0]
        refs = [r for r in re.findall(r"%([\w.\-]+)", body) if r not in called]
        current[name] = (opcode, refs, called)
    return comps


def unordered_collectives(text: str) -> list[tuple[str, str, str]]:
    """``(computation, a, b)`` for every pair of collective-bearing instructions of one
    computation (``ENTRY``: the program's own) that no data path orders (empty: every
    collective runs one at a time)."""
    comps = _parse(text)
    bearing: dict[str, bool] = {}

    def holds(comp: str) -> bool:
        if comp not in bearing:
            bearing[comp] = False
            bearing[comp] = any(op in COLLECTIVES or any(holds(c) for c in called if c in comps)
                                for op, _, called in comps.get(comp, {}).values())
        return bearing[comp]

    out = []
    for comp, instrs in comps.items():
        nodes = [n for n, (op, _, called) in instrs.items()
                 if op in COLLECTIVES or (op in ("while", "conditional", "call") and any(holds(c) for c in called))]
        if len(nodes) < 2:
            continue
        ancestors: dict[str, set] = {}

        def up(n):
            if n not in ancestors:
                seen, stack = set(), [n]
                while stack:
                    for r in instrs.get(stack.pop(), ("", [], []))[1]:
                        if r in instrs and r not in seen:
                            seen.add(r)
                            stack.append(r)
                ancestors[n] = seen
            return ancestors[n]

        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                if a not in up(b) and b not in up(a):
                    out.append((comp, a, b))
    return out
