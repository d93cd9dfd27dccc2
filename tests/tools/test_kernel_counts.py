"""The benchmark's XLA kernel count follows its stated rules
(`benchmarks/lsbench/kernel_counts.py`), on hand-written HLO and on what the
installed TensorFlow compiles; no timing, and no count that depends on the
compiler's fusion decisions is asserted."""

import sys

import pytest
import tensorflow as tf

from tests import helpers

sys.path.insert(0, str(helpers.ROOT / "benchmarks"))

from lsbench import kernel_counts  # pylint: disable=g-import-not-at-top,wrong-import-position

# Every rule once: free instructions, fusions of two kinds, an unfused
# reduce, a copy, an asynchronous pair, a call, a while loop and a
# conditional whose branches launch 2 and 1 kernels. Operands are written
# with their shapes, as TF 2.16 prints them.
_HLO = """\
HloModule tiny, entry_computation_layout={(f32[8]{0}, pred[])->(f32[8]{0})}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(f32[8]{0} %p)
}

%on_true (t: (f32[8])) -> (f32[8]) {
  %t = (f32[8]{0}) parameter(0)
  %a = f32[8]{0} get-tuple-element((f32[8]{0}) %t), index=0
  %f1 = f32[8]{0} fusion(f32[8]{0} %a), kind=kLoop, calls=%fused
  %f2 = f32[8]{0} fusion(f32[8]{0} %f1), kind=kLoop, calls=%fused
  ROOT %r = (f32[8]{0}) tuple(f32[8]{0} %f2)
}

%on_false (f: (f32[8])) -> (f32[8]) {
  %f = (f32[8]{0}) parameter(0)
  %b = f32[8]{0} get-tuple-element((f32[8]{0}) %f), index=0
  %c = f32[8]{0} copy(f32[8]{0} %b)
  ROOT %s = (f32[8]{0}) tuple(f32[8]{0} %c)
}

%body (w: f32[8]) -> f32[8] {
  %w = f32[8]{0} parameter(0)
  ROOT %g = f32[8]{0} fusion(f32[8]{0} %w), kind=kLoop, calls=%fused
}

%cond (v: f32[8]) -> pred[] {
  %v = f32[8]{0} parameter(0)
  ROOT %k = pred[] constant(false)
}

%called (u: f32[8]) -> f32[8] {
  %u = f32[8]{0} parameter(0)
  ROOT %h = f32[8]{0} fusion(f32[8]{0} %u), kind=kInput, calls=%fused
}

ENTRY %main (arg0: f32[8], arg1: pred[]) -> (f32[8]) {
  %arg0 = f32[8]{0} parameter(0)
  %arg1 = pred[] parameter(1)
  %zero = f32[] constant(0)
  %bc = f32[2,4]{1,0} bitcast(f32[8]{0} %arg0)
  %red = f32[] reduce(f32[8]{0} %arg0, f32[] %zero), dimensions={0}, to_apply=%add
  %cp = f32[8]{0} copy(f32[8]{0} %arg0)
  %cs = (f32[8]{0}, f32[8]{0}) copy-start(f32[8]{0} %cp)
  %cd = f32[8]{0} copy-done((f32[8]{0}, f32[8]{0}) %cs)
  %tup = (f32[8]{0}) tuple(f32[8]{0} %cd)
  %if = (f32[8]{0}) conditional(pred[] %arg1, (f32[8]{0}) %tup, (f32[8]{0}) %tup), true_computation=%on_true, false_computation=%on_false
  %out = f32[8]{0} get-tuple-element((f32[8]{0}) %if), index=0
  %loop = f32[8]{0} while(f32[8]{0} %out), condition=%cond, body=%body
  %called = f32[8]{0} call(f32[8]{0} %loop), to_apply=%called
  ROOT %root = (f32[8]{0}) tuple(f32[8]{0} %called)
}
"""


def test_the_count_follows_the_rules_on_a_known_module():
    launches = kernel_counts.count(_HLO)
    # reduce, copy, copy-start, conditional + 2 in its true branch, 1 in
    # the loop's body, 1 in the called computation.
    assert launches.by_opcode == {
        "reduce": 1, "copy": 1, "copy-start": 1, "conditional": 1,
        "fusion:kLoop": 3, "fusion:kInput": 1}
    assert launches.kernels == 8
    assert (launches.conditionals, launches.loops) == (1, 1)


def test_a_conditional_counts_the_branch_it_is_told_a_finite_step_takes():
    launches = kernel_counts.count(
        _HLO, branch=lambda instruction: instruction.called[
            "false_computation"])
    assert launches.kernels == 8 - 2 + 1
    assert launches.by_opcode["copy"] == 2


def test_shapes_printed_without_operand_shapes_parse_alike():
    # TF 2.21 prints operands without their shapes.
    bare = _HLO
    for shape in ("f32[8]{0} %", "pred[] %", "f32[] %", "(f32[8]{0}) %",
                  "(f32[8]{0}, f32[8]{0}) %"):
        bare = bare.replace(shape, "%")
    assert bare != _HLO
    assert kernel_counts.count(bare) == kernel_counts.count(_HLO)


def test_text_without_an_entry_computation_is_refused():
    with pytest.raises(ValueError, match="no ENTRY"):
        kernel_counts.count(_HLO.replace("ENTRY ", ""))


def test_the_installed_tensorflow_gives_the_optimized_hlo_of_a_step():
    # The public API the benchmark reads, on this TensorFlow: a step with a
    # branch XLA keeps (a matrix product is no select) and one it has none.
    x = tf.Variable(tf.ones([4, 4]))

    @tf.function(jit_compile=True)
    def branching():
        return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, x),
                       lambda: x * 2.0)

    @tf.function(jit_compile=True)
    def straight():
        return tf.reduce_sum(x * 2.0)

    kept = kernel_counts.count(kernel_counts.optimized_hlo(branching))
    assert kept.conditionals == 1
    taken_false = kernel_counts.count(
        kernel_counts.optimized_hlo(branching),
        branch=lambda instruction: instruction.called["false_computation"])
    assert kept.kernels >= 2 and taken_false.kernels >= 2
    plain = kernel_counts.count(kernel_counts.optimized_hlo(straight))
    assert plain.kernels >= 1
    assert (plain.conditionals, plain.loops) == (0, 0)
