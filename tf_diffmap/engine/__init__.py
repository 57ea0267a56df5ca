"""The engine: what runs the replicas.

The feed that hands out shards (`feed`, `shards`, `inputs`, `outputs`),
the replica loops and their threads (`loops`, `workers`, `replicas`), the
per-replica step that reads, computes and pushes (`replica_step`), the
runtime that owns them for the life of a strategy (`runtime`), and the
collapse guard (`guard`). It drives the layers below (`tf_diffmap.updates`,
`tf_diffmap.store`); the adapter (`tf_diffmap.strategy`) drives it.
"""
