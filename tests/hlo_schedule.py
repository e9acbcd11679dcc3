"""Reading a compiled (scheduled) XLA module's text: what runs between each start of an
overlapped jax_cpgrad call and its done, and whether anything reads a start's results before its
done. Each computation's instruction order is its schedule; work hidden in called computations
(fusions, command buffers) counts where it is called. A done belongs to the start whose results
reach it (through get-tuple-element, tuple, bitcast and barrier, which only forward buffers).
XLA may wrap a call whose operands are slices in a fusion of its own (``dynamic-slice-fusion``:
the call reads the slices where they lie); such a fusion is read as the call it wraps."""

from __future__ import annotations

import dataclasses
import re

_HEAD = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_CALLED = re.compile(r"(?:to_apply|calls)=(%[\w.\-]+(?:, %[\w.\-]+)*)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# cuDNN's attention and the project's Pallas Mosaic GPU kernels (mosaic_gpu_v2) are matmul work too.
_MATMUL_TARGET = re.compile(r"cublas|gemm|matmul|cudnn\$fmha|mosaic_gpu", re.I)
_FORWARDING = {"get-tuple-element", "tuple", "bitcast", "opt-barrier"}


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    operands: list[str]
    rest: str  # attributes after the operand list

    @property
    def target(self) -> str | None:
        m = _TARGET.search(self.rest)
        return m.group(1) if m else None


def computations(hlo_text: str) -> dict[str, list[str]]:
    """{name: instruction lines} of every computation in a module's text, "ENTRY" for the entry."""
    out, name, body = {}, None, []
    for line in hlo_text.splitlines():
        if name is None:
            m = re.match(r"(ENTRY )?%(\S+) .*\{$", line)
            if m:
                name, body = m.group(2), []
                if m.group(1):
                    out["ENTRY"] = body
        elif line == "}":
            out[name], name = body, None
        else:
            body.append(line)
    return out


def _parse(line: str) -> Instr | None:
    """One instruction line: `%name = <shape> opcode(<operands>), <attributes>`. Shapes may be
    tuples and operands may carry their shapes, so the operand list is found by its matching
    parenthesis. None for lines that define nothing; ValueError for one that cannot be read."""
    head = _HEAD.match(line)
    if not head:
        return None
    text, i, depth = line[head.end() :], 0, 0
    while i < len(text) and (depth or text[i] != " "):  # skip the shape, which may hold spaces in ()
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    m = re.match(r" ([\w\-]+)\(", text[i:])
    if not m:
        raise ValueError(f"cannot read the instruction: {line.strip()[:200]}")
    start = i + m.end()
    j, depth = start, 1
    while depth:
        if j == len(text):
            raise ValueError(f"unbalanced operand list: {line.strip()[:200]}")
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        j += 1
    # an operand may be one element of a tuple: "%t#2" is element 2 of %t
    operands = re.findall(r"%([\w.\-]+(?:#\d+)?)", text[start : j - 1])
    return Instr(head.group(1), m.group(1), operands, text[j:].split(", metadata=")[0])


# What a wrapped call's operand may be computed from inside its fusion: views of one parameter.
_VIEWS = {"slice", "dynamic-slice", "bitcast", "reshape"}


def _fused(ins: Instr | None) -> str | None:
    """The computation a fusion instruction calls; None for any other instruction."""
    m = _CALLED.search(ins.rest) if ins is not None and ins.opcode == "fusion" else None
    return m.group(1).lstrip("%") if m else None


def _wrapped_calls(bodies: dict[str, list[str]]) -> dict[str, tuple[str, list[int | None]]]:
    """{fusion computation: (target, for each of the call's operands the fusion operand it is a
    view of, None if it is computed otherwise)} for every fusion whose root is a jax_cpgrad
    custom call."""
    fusions = {_fused(_parse(ln)) for lines in bodies.values() for ln in lines} - {None}
    found = {}
    for name in fusions & bodies.keys():
        lines = bodies[name]
        instrs = {i.name: i for i in map(_parse, lines) if i is not None}
        root = next((_parse(ln) for ln in lines if ln.lstrip().startswith("ROOT ")), None)
        if root is None or not (root.target or "").startswith("jax_cpgrad_"):
            continue
        params = {}
        for ln in lines:
            m = re.match(r"\s*%([\w.\-]+) = .* parameter\((\d+)\)", ln)
            if m:
                params[m.group(1)] = int(m.group(2))
        found[name] = (root.target, [_view_of(o, instrs, params) for o in root.operands])
    return found


def _view_of(value: str, instrs: dict[str, Instr], params: dict[str, int]) -> int | None:
    """The parameter (its index) that ``value`` is a view of inside a fusion; None if none."""
    while value not in params:
        ins = instrs.get(value.split("#")[0])
        if ins is None or ins.opcode not in _VIEWS or not ins.operands:
            return None
        value = ins.operands[0]
    return params[value]


def _unwrapped(ins: Instr, wrapped: dict[str, tuple[str, list[int | None]]]) -> Instr:
    """``ins`` itself, or for a fusion that wraps a jax_cpgrad call, that call with the fusion's
    operands (an operand computed inside the fusion from several is left out)."""
    callee = _fused(ins)
    if callee not in wrapped:
        return ins
    target, sources = wrapped[callee]
    operands = [ins.operands[i] for i in sources if i is not None]
    return Instr(ins.name, "custom-call", operands, f'custom_call_target="{target}"')


def _does_matmul(ins: Instr, bodies: dict[str, list[str]], seen: set[str]) -> bool:
    if ins.opcode == "dot" or (ins.target and _MATMUL_TARGET.search(ins.target)):
        return True
    for group in _CALLED.findall(ins.rest):
        for callee in (c.strip().lstrip("%") for c in group.split(",")):
            if callee in bodies and callee not in seen:
                seen.add(callee)
                inner = (_parse(line) for line in bodies[callee])
                if any(i is not None and _does_matmul(i, bodies, seen) for i in inner):
                    return True
    return False


def _held(operand: str, carries: dict[str, set[str]], elements: dict[str, list[set[str]]]) -> set[str]:
    """The starts whose results an operand holds (``%t#i``: only those of the tuple's element i)."""
    name, _, index = operand.partition("#")
    if index and name in elements:
        return elements[name][int(index)]
    return carries.get(name, set())


@dataclasses.dataclass
class Pair:
    target: str
    start: int  # positions in the computation's schedule
    done: int | None = None
    matmuls_between: int = 0
    early_readers: list[str] = dataclasses.field(default_factory=list)  # read results before the done


def pairs(hlo_text: str) -> list[Pair]:
    """Every overlapped call's start in the module, schedule order within each computation."""
    bodies = computations(hlo_text)
    wrapped = _wrapped_calls(bodies)
    found = []
    for name, lines in bodies.items():
        if name == "ENTRY" or name in wrapped:
            continue  # the entry is also listed under its own name; a wrapper is read where called
        instrs = [_unwrapped(i, wrapped) for i in map(_parse, lines) if i is not None]
        starts = {
            i.name: Pair(i.target, pos)
            for pos, i in enumerate(instrs)
            if (i.target or "").startswith("jax_cpgrad_") and i.target.endswith("_start")
        }
        if not starts:
            continue
        carries: dict[str, set[str]] = {s: {s} for s in starts}  # value -> starts whose results it holds
        elements: dict[str, list[set[str]]] = {}  # tuple value -> the same, per element
        for pos, ins in enumerate(instrs):
            of = [_held(o, carries, elements) for o in ins.operands]
            held = set().union(*of)
            if ins.name in starts:  # a start reading another start's results is a reader too
                for s in held:
                    if starts[s].done is None:
                        starts[s].early_readers.append(ins.name)
                continue
            if ins.opcode == "tuple":
                elements[ins.name] = of
            elif ins.opcode == "opt-barrier" and ins.operands and ins.operands[0] in elements:
                elements[ins.name] = elements[ins.operands[0]]
            elif ins.opcode == "get-tuple-element" and ins.operands[0] in elements:
                index = int(re.search(r"index=(\d+)", ins.rest).group(1))
                held = elements[ins.operands[0]][index]
            if ins.target == "jax_cpgrad_done":
                # Its first half of operands are the results of its own start; the rest are that
                # start's inputs, which may hold another start's results (read by this one).
                half = len(ins.operands) // 2
                own = set().union(*of[:half])
                for s in own:
                    starts[s].done = pos if starts[s].done is None else starts[s].done
                for s in set().union(*of[half:]) - own:
                    if starts[s].done is None:
                        starts[s].early_readers.append(ins.name)
            elif ins.opcode in _FORWARDING:
                carries[ins.name] = held
            else:
                for s in held:
                    if starts[s].done is None:
                        starts[s].early_readers.append(ins.name)
            if _does_matmul(ins, bodies, set()):
                for p in starts.values():
                    if p.start < pos and p.done is None:
                        p.matmuls_between += 1
        found += sorted(starts.values(), key=lambda p: p.start)
    return found


def matmuls_between_pairs(hlo_text: str) -> list[tuple[str, int]]:
    """(target, matrix-multiply instructions scheduled between the start and its done) per start."""
    return [(p.target, p.matmuls_between) for p in pairs(hlo_text)]
