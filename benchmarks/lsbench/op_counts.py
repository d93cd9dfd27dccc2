"""Counting the ops of a traced step, branches included.

A `tf.cond` in a `tf.function` becomes an `If` op whose branches are
functions of the graph's library; TensorFlow lowers them into the graph it
runs, where an op of the branch not taken still costs the executor about as
much as a small op that runs (it is visited and marked dead: about a
microsecond each, measured on this project's 2-core machines). So a step's
cost per tensor follows the ops of both branches, and they are counted
together: every node of the traced graph and of every function in its
library, except `Placeholder` (the captured inputs).

These are the ops as traced, before Grappler's rewrites (which, for
instance, merge equal constants): the same measure for every candidate.
"""

import collections

import tensorflow as tf

_NOT_COUNTED = ("Placeholder",)


def op_types(function):
    """A `collections.Counter` of op type -> count, for a `tf.function`
    taking no arguments (traced here) or a concrete function."""
    if hasattr(function, "get_concrete_function"):
        function = function.get_concrete_function()
    graph_def = function.graph.as_graph_def()
    counts = collections.Counter(
        node.op for node in graph_def.node if node.op not in _NOT_COUNTED)
    for library_function in graph_def.library.function:
        counts.update(node.op for node in library_function.node_def)
    return counts


def traced_apply(optimizer, grads, variables, jit_compile=False,
                 strategy=None):
    """The op types of `optimizer.apply(grads, variables)` traced as one
    `tf.function`, as a training step calls it (Keras protocol: the
    gradients are scaled and the optimizer unscales them), in `strategy.run`
    if a strategy is given (the optimizer and variables made in its scope).
    """
    optimizer.build(variables)
    optimizer.scale_loss(tf.constant(1.0))  # The Keras 3 protocol.

    def apply():
        optimizer.apply(grads, variables)

    @tf.function(jit_compile=jit_compile)
    def step():
        if strategy is None:
            apply()
        else:
            strategy.run(apply)

    # Under XLA a loss scale whose policy asks for failures or warnings may
    # only be traced while a watch of it is live (tf_lossscale.loss_scales.xla_checks);
    # the default one, traced here, needs none.
    return op_types(step)


def removed(full, ablated):
    """Op type -> how many fewer the ablated step has (only those fewer)."""
    return collections.Counter({
        op: full[op] - ablated[op] for op in full if full[op] > ablated[op]})


def describe(counts, top=4):
    """`'12 (Sum 6, If 1, ...)'`: the total and the largest few."""
    total = sum(counts.values())
    parts = ", ".join(f"{op} {n}" for op, n in counts.most_common(top))
    return f"{total} ({parts})" if parts else str(total)
