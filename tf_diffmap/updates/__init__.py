"""Updates: how a replica's gradient becomes a change of the store.

The optimizer wrapper and its staleness-aware rules (`optimizer`, `rules`,
`momentum`), the versioned step that claims and records an update (`step`),
row updates for sparse gradients (`sparse`), and the aggregation of shard
gradients into one step of the inner optimizer (`aggregation`). Everything
here writes through `tf_diffmap.store`.
"""
