"""Row reads of large tables inside a replica step.

Keras reads an embedding table whole and gathers rows from the copy. Inside
a replica step a large store variable's read gets a stand-in instead
(`variables.InStore._stands_in`); at the step's version claim
`resolve_row_reads` rewires each gather of a stand-in to a gather beside
the table, which moves only the rows, through the private
`Operation._update_input` (`graphs.reroute`).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_diffmap._tf_internal.graphs import reroute
from tf_diffmap._tf_internal.variables import replica_tracing


@dataclasses.dataclass
class RowReads:
    """How one replica step read a large variable.

    Attributes:
        variable: the variable.
        lookups: `(ids, rows)` of each row gather, flattened: ids `[n]`
            (int64), rows `[n, ...]`, read where the variable lives.
        value: a whole read of it, made when something used its value
            other than by gathering rows; else None.
        replaced: `(stand-in or gather, its replacement)` pairs, for uses
            made after the claim (`rewire_late_uses`).
    """

    variable: object
    lookups: list[tuple[tf.Tensor, tf.Tensor]]
    value: tf.Tensor | None = None
    replaced: list[tuple[tf.Tensor, tf.Tensor | None]] = dataclasses.field(default_factory=list)


def _gathers_rows(op, stand_in: tf.Tensor) -> bool:
    return (
        op.type == "GatherV2"
        and op.inputs[0] is stand_in
        and all(t is not stand_in for t in op.inputs[1:])
        and tf.get_static_value(op.inputs[2]) == 0
        and op.get_attr("batch_dims") == 0
    )


def resolve_row_reads() -> dict[int, RowReads]:
    """Gives the stand-ins of this replica step their reads (at its claim).

    Each row gather of a stand-in becomes a `ResourceGather` of the same
    ids, which runs beside the variable and moves only the rows (for a
    variable split by rows, one beside each shard, of the ids it holds,
    the rows put back in order where the step runs); every other user of a
    stand-in (an op that needs the whole value) reads the variable whole.
    The reads run after what the stand-in waited for (the step's read of
    the store version), and, being made before the step's first update,
    before any update of the step (`tf.function` orders the ops on one
    variable in the order they were made). From here on the step reads its
    variables as usual.

    Uses the private `Operation._update_input` (`graphs.reroute`).

    Returns:
        Per variable id, how the step read it.
    """
    tracing = replica_tracing()
    pending, tracing.stand_ins = tracing.stand_ins, {}
    tracing.reads_as_rows = False
    resolved: dict[int, RowReads] = {}
    if not pending:
        return resolved
    with tracing.step_graph.as_default(), tf.control_dependencies(None):
        for key, (variable, stand_ins) in pending.items():
            reads = resolved[key] = RowReads(variable, [])
            row_shape = variable.shape.as_list()[1:]
            for stand_in in stand_ins:
                waits = list(stand_in.op.inputs[0].op.control_inputs) + list(
                    stand_in.op.control_inputs
                )
                with tf.control_dependencies(waits), tf.device(stand_in.device):
                    others = []
                    for op in list(stand_in.consumers()):
                        if not _gathers_rows(op, stand_in):
                            others.append(op)
                            continue
                        rows = variable._gather_where_stored(op.inputs[1])
                        reroute(op.outputs[0], rows)
                        reads.replaced.append((op.outputs[0], rows))
                        ids = tf.reshape(tf.cast(op.inputs[1], tf.int64), [-1])
                        reads.lookups.append((ids, tf.reshape(rows, [-1, *row_shape])))
                    if others:
                        if reads.value is None:
                            reads.value = variable._read_whole()
                        reroute(stand_in, reads.value, others)
                    reads.replaced.append((stand_in, reads.value))
    return resolved


def rewire_late_uses(resolved: dict[int, RowReads], outputs):
    """Gives the uses of stand-ins and of their gathers made after the claim
    their replacements, and returns `outputs` with them replaced too.

    A use made after the claim of a value read before it (a step that
    returns a lookup's rows, or computes from them once the update is
    applied) gets the read made at the claim, which ran before the update,
    as the value it stands for did.

    Raises:
        ValueError: a use of a table's whole value read before the claim,
            made after it, when nothing before the claim read it whole (a
            whole read made now would see the step's own update).
    """
    replacements = {}
    for reads in resolved.values():
        gathers = {old.op for old, _ in reads.replaced if old.op.type == "GatherV2"}
        for old, new in reads.replaced:
            late = [op for op in old.consumers() if op not in gathers]
            if new is None:
                if late or _is_in(old, outputs):
                    user = late[0].name if late else "the step's outputs"
                    raise ValueError(
                        f"The value of `{reads.variable.name}` read before this step's "
                        f"update is used after the update, by {user}. Inside a replica "
                        "step tf_diffmap reads a large table by rows, and whole only "
                        "where it is used whole before the update: use its value "
                        "before `apply_gradients`, or read the variable again after "
                        "it (it then holds the updated value)."
                    )
                continue
            reroute(old, new, late)
            replacements[old.ref()] = new
    if not replacements:
        return outputs
    return tf.nest.map_structure(
        lambda t: replacements.get(t.ref(), t) if isinstance(t, tf.Tensor) else t, outputs
    )


def _is_in(tensor: tf.Tensor, structure) -> bool:
    return any(t is tensor for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor))
