"""The verification steps under `jax.shard_map`, on inputs sharded over a device
mesh: `sharded_step`, one module per kind of step, and what they share (placing
the inputs on the mesh, the axes' checks). Imports every step family below it.
See `docs/sharding.md`."""
