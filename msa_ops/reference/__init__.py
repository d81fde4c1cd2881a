"""Plain ``jax.numpy`` implementations of every op: the executable form of SPEC.md."""
