"""Reading a compiled (scheduled) XLA module's text: what runs between each start of an
overlapped jax_cpgrad call and its done. The entry computation's instruction order is the
schedule; work hidden in called computations (fusions, command buffers) counts where it is
called."""

from __future__ import annotations

import re

_MATMUL = re.compile(r"\bdot\(|__cublas|gemm|matmul", re.I)
_CALLED = re.compile(r"(?:to_apply|calls)=(%[\w.\-]+(?:, %[\w.\-]+)*)")


def computations(hlo_text: str) -> dict[str, str]:
    """{name: body} of every computation in a module's text, plus "ENTRY" for the entry one."""
    out, name, body, entry = {}, None, [], None
    for line in hlo_text.splitlines():
        if name is None:
            m = re.match(r"(ENTRY )?%(\S+) .*\{$", line)
            if m:
                name, body = m.group(2), []
                entry = name if m.group(1) else entry
        elif line == "}":
            out[name], name = "\n".join(body), None
        else:
            body.append(line)
    if entry is not None:
        out["ENTRY"] = out[entry]
    return out


def _has_matmul(line: str, bodies: dict[str, str], seen: set[str]) -> bool:
    if _MATMUL.search(line):
        return True
    for group in _CALLED.findall(line):
        for callee in (c.strip().lstrip("%") for c in group.split(",")):
            if callee not in seen and callee in bodies:
                seen.add(callee)
                if any(_has_matmul(inner, bodies, seen) for inner in bodies[callee].splitlines()):
                    return True
    return False


def matmuls_between_pairs(hlo_text: str) -> list[tuple[str, int]]:
    """For each start of an overlapped call in the entry's schedule, in order: (its target, how
    many instructions doing matrix multiplies ran before the done that follows it)."""
    bodies = computations(hlo_text)
    pairs, open_starts = [], []
    for line in bodies.get("ENTRY", "").splitlines():
        target = re.search(r'custom_call_target="(jax_cpgrad_\w+)"', line)
        if target and target.group(1).endswith("_start"):
            open_starts.append([target.group(1), 0])
        elif target and target.group(1) == "jax_cpgrad_done":
            if open_starts:
                pairs.append(tuple(open_starts.pop(0)))
        elif open_starts and _has_matmul(line, bodies, set()):
            for pending in open_starts:
                pending[1] += 1
    return pairs + [tuple(p) for p in open_starts]
