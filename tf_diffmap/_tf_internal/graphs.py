"""Rewrites of a replica step's graph while it is traced.

`tf.function` offers no public way to change an op once it is made. The
rewrites here change where ops run (`place_scalars_beside_reads`) and what
they take as input (`pack_crossings`, and the row reads of `row_reads`),
through the private `tf.Operation` members named below, and predict the
control dependencies that `tf.function` adds once the trace ends
(`successors`). Every value and every dependency stays as traced: only
placement and the transfers between devices change.
"""

from __future__ import annotations

import tensorflow as tf

from tf_diffmap.devices import task_parts

# The private members of `tf.Operation` the rewrites use (checked by
# `checks.compatibility_problems`, exercised by tests/test_tf_internal.py).
OPERATION_MEMBERS = (
    "_set_device",
    "_update_input",
    "_is_stateful",
    "_remove_all_control_inputs",
    "_add_control_inputs",
)


def set_device(op, device: str) -> None:
    """Places `op`, made earlier in the graph being traced, on `device`."""
    op._set_device(device)  # noqa: SLF001


def update_input(op, index: int, tensor: tf.Tensor) -> None:
    """Makes `op`, made earlier in the graph being traced, take `tensor` as
    its input `index`."""
    op._update_input(index, tensor)  # noqa: SLF001


def replace_control_inputs(op, control_inputs) -> None:
    """Makes `op`, made earlier in the graph being traced, wait for
    `control_inputs` instead of the ops it waited for."""
    op._remove_all_control_inputs()  # noqa: SLF001
    op._add_control_inputs(control_inputs)  # noqa: SLF001


def is_stateful(op) -> bool:
    """Whether `op` has side effects, as its op definition says."""
    return bool(op._is_stateful)  # noqa: SLF001


def nested_graphs(graph) -> list:
    """`graph` and the graphs of the functions its ops call, depth first:
    a conditional's branches, a loop's body and condition, a called
    function's (through the private `FuncGraph._functions`)."""
    found, stack, seen = [], [graph], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        functions = getattr(current, "_functions", {})
        for op in current.get_operations():
            for attr in op.node_def.attr.values():
                names = [attr.func.name] if attr.HasField("func") else []
                names += [f.name for f in attr.list.func]
                for name in names:
                    function = functions.get(name)
                    if function is None:
                        function = getattr(graph, "_functions", {}).get(name)
                    nested = getattr(function, "graph", None)
                    if nested is not None:
                        stack.append(nested)
    return found


def reroute(old: tf.Tensor, new: tf.Tensor, consumers=None) -> None:
    """Makes `consumers` (every consumer of `old` by default) take `new`."""
    for consumer in list(old.consumers() if consumers is None else consumers):
        for index, tensor in enumerate(consumer.inputs):
            if tensor is old:
                update_input(consumer, index, new)


def _device_key(name: str | None) -> tuple | None:
    if not name:
        return None
    spec = tf.DeviceSpec.from_string(name)
    return (*task_parts(name), spec.device_type, spec.device_index)


def _place(op, device: tuple) -> None:
    job, replica, task, device_type, device_index = device
    set_device(op, tf.DeviceSpec(job, replica, task, device_type, device_index).to_string())


def _placed_by_scope(op, away: tuple | None) -> bool:
    """Whether `op` is where the step's device scope put it, and nothing
    else (a `colocate_with`) ties it to another op."""
    if _device_key(op.device) != away:
        return False
    try:
        op.get_attr("_class")
    except ValueError:
        return True
    return False


def place_scalars_beside_reads(graph, replica_device: str) -> int:
    """Places a traced step's scalar ops that use only values read from one
    other device on that device.

    A replica step is traced on its replica's device, and so is the
    arithmetic it does on what it reads from the parameter store: a metric's
    `total / count`, a constant added to a counter. Run on the replica's
    device, each such scalar travels to it and back, a transfer between
    devices at every step; run beside the variables it reads, it does not.
    An op moves when it is stateless, every output is a scalar, and its
    inputs are values read from variables of one device other than the
    replica's (or ops that moved there), besides constants; a constant moves
    with the ops that use it, when they are all there. Only where ops run
    changes: every value and every dependency stays as traced. Ops of
    nested graphs (conditionals' branches) are left where they are.

    Uses the private `Operation._set_device` (`set_device`).

    Args:
        graph: the step's graph, while it is traced (before it becomes a
            function).
        replica_device: the replica's device.

    Returns:
        How many ops moved.
    """
    away = _device_key(replica_device)
    handles = {
        id(internal): _device_key(external.device)
        for external, internal in graph.captures
        if getattr(external, "dtype", None) == tf.resource and getattr(external, "device", "")
    }
    constant = object()
    where: dict[str, object] = {}
    beside: dict[str, tuple] = {}  # ops placed on a device other than the replica's
    moved = 0
    operations = graph.get_operations()
    for op in operations:
        if op.type == "ReadVariableOp":
            where[op.name] = handles.get(id(op.inputs[0]))
            continue
        if op.type == "Const":
            where[op.name] = constant
            continue
        if is_stateful(op) or not op.inputs or not op.outputs:
            if op.inputs and op.inputs[0].dtype == tf.resource:
                device = handles.get(id(op.inputs[0]))
                if device is not None and device != away:
                    beside[op.name] = device
            continue
        sources = {where.get(t.op.name) for t in op.inputs} - {constant}
        if not sources:
            where[op.name] = constant
            continue
        device = sources.pop() if len(sources) == 1 else None
        scalar = all(t.shape.rank == 0 for t in op.outputs)
        inherited = _placed_by_scope(op, away)
        if device is not None and device != away and scalar and inherited:
            _place(op, device)
            where[op.name] = device
            beside[op.name] = device
            moved += 1
    # Constants (and ops of constants only) follow their consumers, last first.
    for op in reversed(operations):
        if where.get(op.name) is not constant:
            continue
        consumers = [c for t in op.outputs for c in t.consumers()]
        devices = {beside.get(c.name) for c in consumers}
        inherited = _placed_by_scope(op, away)
        if consumers and inherited and len(devices) == 1 and None not in devices:
            device = devices.pop()
            _place(op, device)
            beside[op.name] = device
            moved += 1
    return moved


# Where the ops that pack and unpack the values crossing between tasks are named.
PACKED_SCOPE = "tf_diffmap_packed"

# What travels packed: a pack holds the bytes of values of any of these.
_PACKED_DTYPES = frozenset(
    {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.bool}
    | {tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16}
)

# Conditionals: TensorFlow lowers one to switches beside each input's maker
# and merges on the conditional's own device.
_CONDITIONALS = frozenset({"If", "StatelessIf"})

# Values above this size travel alone: their transfer's fixed cost is small
# beside their bytes, and joining them would only copy them once more.
PACK_MAX_BYTES = 1 << 20

# Ops that run functions: a resource they take does not place them.
_CALLS = frozenset(
    {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"}
    | {"PartitionedCall", "StatefulPartitionedCall"}
)


def _full_device(name: str | None) -> str | None:
    """`name` if it names a task and a device completely, else None."""
    key = _device_key(name)
    if key is None or None in key:
        return None
    return tf.DeviceSpec.from_string(name).to_string()


def _runs_on(op, handles: dict[int, str]) -> str | None:
    """Where the placer will put `op`, when the graph already says so: beside
    the variable of its resource input, or on its own full device. None
    when that is for the placer to decide (a `colocate_with`, a partial or
    empty device, a call of a function or a loop, whose ops go where their
    own devices say). A conditional of a full device runs there: its
    merges do, and its switches once `_bring_to_conditionals` has run."""
    if op.type in _CONDITIONALS:
        # Its outputs come from its merges, on its device.
        return _full_device(op.device)
    if op.type in _CALLS:
        return None
    for tensor in op.inputs:
        if tensor.dtype == tf.resource:
            return handles.get(id(tensor))
    try:
        op.get_attr("_class")
    except ValueError:
        return _full_device(op.device)
    return None


def successors(operations) -> dict:
    """Each op's successors: its consumers and control outputs, and the edges
    that `tf.function`'s automatic control dependencies add once the trace
    ends (each op on a resource after the previous one on it; stateful ops
    without a resource one after the other).

    TensorFlow adds those edges only when the trace ends, after the rewrites
    have run, and has no way to ask for them beforehand: this follows its
    rule, which `tests/test_tf_internal.py` compares with a traced function.
    """
    after: dict = {op: set() for op in operations}
    last: dict = {}
    for op in operations:
        for tensor in op.inputs:
            if tensor.op in after:
                after[tensor.op].add(op)
        for control in op.control_inputs:
            if control in after:
                after[control].add(op)
        keys = [id(t) for t in op.inputs if t.dtype == tf.resource]
        if not keys and is_stateful(op):
            keys = ["stateful"]
        for key in keys:
            if key in last:
                after[last[key]].add(op)
            last[key] = op
    return after


def reaches(after: dict, starts) -> set:
    seen, stack = set(starts), list(starts)
    while stack:
        for nxt in after.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _bring_to_conditionals(graph, operations, where: dict) -> int:
    """Makes each conditional of a full device take the values it gets
    from another task through an identity on its own device.

    TensorFlow lowers a conditional to a switch beside each input's maker,
    so that a value going into a branch on another task travels from
    there, alone, and so does the predicate, to every switch. Taken on the
    conditional's device (where its branches' ops run, the store's ops
    under the store's conditionals), each such value is an ordinary
    crossing at the step's top level, which packs with the others.

    Returns:
        How many inputs it brought.
    """
    brought = 0
    for op in operations:
        target = where.get(op)
        if op.type not in _CONDITIONALS or target is None:
            continue
        for index, tensor in enumerate(op.inputs):
            if tensor.dtype in (tf.resource, tf.variant):
                continue
            # A value of a device not known yet (an argument of the step)
            # is brought too: from another task it then travels once.
            source = where.get(tensor.op)
            if source is not None and task_parts(source) == task_parts(target):
                continue
            with graph.as_default(), tf.name_scope(PACKED_SCOPE + "/"), tf.device(target):
                here = tf.identity(tensor)
            update_input(op, index, here)
            where[here.op] = target
            brought += 1
    return brought


def _byte_size(tensor: tf.Tensor) -> int:
    return tensor.shape.num_elements() * tensor.dtype.size


def _cpu_of(device: str) -> str:
    """The CPU of `device`'s task: where a pack is made and cut (every
    dtype's concatenation and bitcast has a CPU kernel)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def _as_bytes(tensor: tf.Tensor) -> tf.Tensor:
    """`tensor`'s bytes, flat (a truth value as one byte)."""
    flat = tf.reshape(tensor, [-1])
    if tensor.dtype == tf.bool:
        return tf.cast(flat, tf.uint8)
    if tensor.dtype == tf.uint8:
        return flat
    return tf.reshape(tf.bitcast(flat, tf.uint8), [-1])


def _from_bytes(piece: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """The value of `like`'s dtype and shape whose bytes `piece` holds."""
    if like.dtype == tf.bool:
        value = tf.cast(piece, tf.bool)
    elif like.dtype == tf.uint8:
        value = piece
    elif like.dtype.size == 1:
        value = tf.bitcast(piece, like.dtype)
    else:
        value = tf.bitcast(tf.reshape(piece, [-1, like.dtype.size]), like.dtype)
    return tf.reshape(value, like.shape)


def pack_crossings(graph) -> int:
    """Makes the values that a traced step sends from one task to another
    travel as one tensor per pair of devices.

    On a cluster a replica step reads every parameter from a ps task, sends
    every gradient back with its push's counts and flags, and sends its
    metrics' updates to the chief: each value is one transfer between the
    tasks, a remote call with its own fixed cost on both sides, per value
    and per update (a convolutional network with batch normalization has
    dozens of variables). Here the values that go from one device to a
    device of another task (floating-point, integer and truth values) are
    joined where they are made, as their bytes, on their task's CPU, travel
    as one tensor, and are cut apart again where they are used: every op
    that used one of them uses its piece. Only the transfers change: each op
    runs where and after what it ran before, and the values are the same,
    bit for bit.

    A conditional of a full device (the store's, under its mutex) first
    takes what comes from another task through an identity on its own
    device (`_bring_to_conditionals`): lowered, it would otherwise switch
    each value beside its maker and send it into the branch alone, with
    the predicate to every such switch.

    A pair of devices is packed only where both ends are known as the step
    is traced (an op beside the variable it reads or writes, or an op with
    a full device), for values of fully known shape and at most
    `PACK_MAX_BYTES` (a larger value's bytes outweigh its call), two or more
    at a time. Joining values makes each wait for all: a value that depends
    on what is done with another one of its pack (on the far side, or
    through packs already made) is left out, counting the dependencies that
    `tf.function` adds between the ops on one resource once the trace ends;
    what is left out makes packs of its own, by the same rule. An op that
    waits for the maker of a packed value (a claim waits for the
    gradients) waits for its piece instead, on its own task
    (`_wait_for_arrivals`). Ops of nested graphs (conditionals' branches)
    are left as they are; they see the pieces through their graph's inputs.

    Uses the private `Operation._update_input` (`update_input`) and
    `Operation._remove_all_control_inputs` and `_add_control_inputs`
    (`replace_control_inputs`).

    Args:
        graph: the step's graph, while it is traced (before it becomes a
            function), or any graph whose ops name their devices.

    Returns:
        How many values travel packed.
    """
    handles = {
        id(internal): _full_device(external.device)
        for external, internal in getattr(graph, "captures", ())
        if getattr(external, "dtype", None) == tf.resource
    }
    operations = graph.get_operations()
    where = {op: _runs_on(op, handles) for op in operations}
    if _bring_to_conditionals(graph, operations, where):
        operations = graph.get_operations()
    groups: dict[tuple, dict] = {}
    for op in operations:
        source = where[op]
        if source is None:
            continue
        for tensor in op.outputs:
            if tensor.dtype not in _PACKED_DTYPES or not tensor.shape.is_fully_defined():
                continue
            if _byte_size(tensor) > PACK_MAX_BYTES:
                continue
            for consumer in tensor.consumers():
                target = where.get(consumer)
                if target is None or task_parts(target) == task_parts(source):
                    continue
                users = groups.setdefault((source, target), {}).setdefault(tensor.ref(), [])
                for index, given in enumerate(consumer.inputs):
                    if given is tensor and (consumer, index) not in users:
                        users.append((consumer, index))
    after = successors(operations)
    packed = 0
    # Per op whose value travelled packed and task it went to, the piece
    # that arrived there.
    arrived: dict = {}
    with graph.as_default(), tf.name_scope(PACKED_SCOPE + "/"):
        work = list(groups.items())
        while work:
            (source, target), uses = work.pop(0)
            # Leave out what depends on the pack's own consumers, until
            # nothing does; what is left out may make a pack of its own.
            left_out: dict = {}
            while len(uses) > 1:
                downstream = reaches(after, [c for users in uses.values() for c, _ in users])
                cyclic = [ref for ref in uses if ref.deref().op in downstream]
                if not cyclic:
                    break
                for ref in cyclic:
                    left_out[ref] = uses.pop(ref)
            if len(left_out) > 1:
                work.append(((source, target), left_out))
            if len(uses) < 2:
                continue
            values = [ref.deref() for ref in uses]
            with tf.device(_cpu_of(source)):
                joined = tf.concat([_as_bytes(t) for t in values], 0)
            with tf.device(_cpu_of(target)):
                pieces = tf.split(joined, [_byte_size(t) for t in values])
                for tensor, piece in zip(values, pieces):
                    unpacked = _from_bytes(piece, tensor)
                    arrived[tensor.op, task_parts(target)] = (unpacked.op, values)
                    for consumer, index in uses[tensor.ref()]:
                        update_input(consumer, index, unpacked)
            # Later packs must see this one's dependencies: every consumer
            # now waits for every value packed.
            for tensor in values:
                after[tensor.op].update(c for users in uses.values() for c, _ in users)
            packed += len(values)
    _wait_for_arrivals(operations, where, arrived, after)
    return packed


def _wait_for_arrivals(operations, where: dict, arrived: dict, after: dict) -> int:
    """Makes each op that waits for an op of another task whose value came
    to the op's task in a pack wait for the piece that arrived instead: it
    exists only once that op has run, and waiting for it crosses no task (a
    control edge between tasks is a transfer of its own). The piece stands
    in only where no value of its pack comes after the op that would wait
    (`after`, with the edges `tf.function` adds): that op would wait for
    itself.

    Returns:
        How many waits it moved.
    """
    moved = 0
    for op in operations:
        target = where.get(op)
        if target is None or not op.control_inputs:
            continue
        task = task_parts(target)
        downstream = None
        controls = []
        for control in op.control_inputs:
            arrival = arrived.get((control, task))
            if arrival is not None:
                if downstream is None:
                    downstream = reaches(after, [op])
                piece, values = arrival
                if not any(value.op in downstream for value in values):
                    control = piece
            controls.append(control)
        changed = sum(a is not b for a, b in zip(controls, op.control_inputs))
        if changed:
            replace_control_inputs(op, list(dict.fromkeys(controls)))
            moved += changed
    return moved
