"""Counting the kernels a step compiled by XLA launches, from its HLO.

On a GPU the cost of loss scaling is mostly launches and passes over the
gradients, which CPU wall time hides. XLA compiles a `jit_compile=True` step
into one module whose entry computation is the list of what the runtime
launches, in order; this module reads that list from the optimized HLO
(`tf.function.experimental_get_compiler_ir(...)(stage="optimized_hlo")`, a
public API on every supported TensorFlow) and counts, for one step that
applies finite gradients:

* one launch per top-level instruction of the entry computation that does
  work: a fusion (of any kind), a custom call, a copy, and any instruction
  XLA left unfused (a reduce, a reduce-window, a slice, ...);
* nothing for what only names or reinterprets buffers: `parameter`,
  `constant`, `tuple`, `get-tuple-element`, `bitcast`, `after-all`,
  `add-dependency`, `opt-barrier`, `domain`; an asynchronous pair counts
  once (its `-start`);
* a `conditional`: one launch for the predicate, which the runtime copies
  to the host before it picks the branch, and is counted again in
  `Launches.conditionals` (on a GPU: a wait for the device); then the
  launches of the branch a finite step takes, counted by the same rules. In
  the steps measured here, that is the true branch of each conditional (the
  finiteness sentinel's "the sum is finite", the step's "apply"); `count`
  takes another choice as an argument;
* a `while`: its condition and body once (a trip count is not known from
  the HLO), and counted in `Launches.loops` so that a table can say so;
* a `call` (rare after optimization): the launches of the computation it
  calls.

Where this maps to a GPU and where it does not (docs/guides/performance.md):
the CPU's pipeline wraps single elementwise instructions in fusions of their
own and splits large reductions into chains of reduce-windows, where GPU
XLA fuses an elementwise producer into its reduction and reduces in one or
two kernels; it compiles some reductions to library calls (the `__ynn`
custom fusions of TF 2.21). The counts compare candidates compiled by the
same compiler, not a CPU with a GPU.
"""

import collections
import re
from typing import NamedTuple

FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast",
    "after-all", "add-dependency", "opt-barrier", "domain"})

_COMPUTATION = re.compile(r"^(ENTRY )?%?([^\s(]+) \(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([^\s=]+) = (.*)$")
_CALLED = re.compile(
    r"\b(true_computation|false_computation|body|condition|to_apply|calls)="
    r"%?([^\s,}]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


class Instruction(NamedTuple):
    name: str
    opcode: str
    called: dict  # Attribute -> computation name; "branches" -> [names].
    kind: str  # A fusion's kind (kLoop, kInput, kOutput, kCustom), or "".


class Launches(NamedTuple):
    """What one step launches.

    Attributes:
      kernels: launches on a step that applies finite gradients.
      conditionals: the conditionals that step runs (each reads its
        predicate on the host first; counted in `kernels` too).
      loops: `while` loops (their bodies counted once).
      by_opcode: a `collections.Counter` of launches by opcode; fusions as
        `fusion:<kind>`.
    """
    kernels: int
    conditionals: int
    loops: int
    by_opcode: collections.Counter


def _split_shape(text):
    """(shape, rest) of an instruction's right-hand side."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return text[:index + 1], text[index + 1:].lstrip()
    raise ValueError(f"unbalanced shape in HLO: {text[:80]!r}")


def parse(hlo_text):
    """(entry name, {computation name: [Instruction]}) of an HLO module's
    text, as `experimental_get_compiler_ir` prints it."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match and line.rstrip().endswith("{"):
                current = computations.setdefault(match.group(2), [])
                if match.group(1):
                    entry = match.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        _, rest = _split_shape(match.group(2))
        opcode = rest.partition("(")[0].strip()
        called = {key: value for key, value in _CALLED.findall(rest)}
        branches = _BRANCHES.search(rest)
        if branches:
            called["branches"] = [name.strip().lstrip("%") for name
                                  in branches.group(1).split(",")]
        kind = re.search(r"\bkind=(k\w+)", rest)
        current.append(Instruction(match.group(1), opcode, called,
                                   kind.group(1) if kind else ""))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, computations


def finite_step_branch(instruction):
    """The branch a finite step takes in the steps measured here: the true
    one (see the module docstring)."""
    called = instruction.called
    if "true_computation" in called:
        return called["true_computation"]
    raise ValueError(
        f"conditional {instruction.name} has branch_computations: say which "
        "branch a finite step takes (count(..., branch=...))")


def count(hlo_text, branch=finite_step_branch):
    """The `Launches` of the entry computation of `hlo_text`.

    Args:
      hlo_text: an optimized HLO module, as text.
      branch: `branch(conditional Instruction)` -> the name of the branch
        computation a finite step takes.
    """
    entry, computations = parse(hlo_text)
    by_opcode = collections.Counter()
    totals = collections.Counter()

    def visit(name):
        for instruction in computations[name]:
            opcode = instruction.opcode
            if opcode in FREE or opcode.endswith("-done"):
                continue
            if opcode == "call":
                visit(instruction.called["to_apply"])
                continue
            if opcode == "while":
                totals["loops"] += 1
                visit(instruction.called["condition"])
                visit(instruction.called["body"])
                continue
            key = (f"fusion:{instruction.kind}" if opcode == "fusion"
                   and instruction.kind else opcode)
            by_opcode[key] += 1
            if opcode == "conditional":
                totals["conditionals"] += 1
                visit(branch(instruction))

    visit(entry)
    return Launches(sum(by_opcode.values()), totals["conditionals"],
                    totals["loops"], by_opcode)


def optimized_hlo(step):
    """The optimized HLO text of `step`, a `tf.function(jit_compile=True)`
    taking no arguments, as compiled for this machine's CPU."""
    return step.experimental_get_compiler_ir()(stage="optimized_hlo")


def describe(launches, top=3):
    """`'23 (fusion:kLoop 19, copy 2, conditional 1)'`."""
    parts = ", ".join(f"{op} {n}"
                      for op, n in launches.by_opcode.most_common(top))
    return f"{launches.kernels} ({parts})" if parts else str(launches.kernels)
