"""HTTP routes, one module per concept: completions, chat, and the small operational endpoints."""
