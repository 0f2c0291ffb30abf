"""Programs that run a worker's code outside the serving loop (python -m worker_proc.tools.NAME)."""
