"""The scheduler process: request lifecycle, KV block accounting, scheduling policy and the step loop."""
