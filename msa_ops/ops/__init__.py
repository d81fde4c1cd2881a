"""Op definitions: shape rules, native lowering adapters and the Python wrappers, one module per family."""
