"""The supervisor: resolves the model, starts every process, watches and stops them."""
