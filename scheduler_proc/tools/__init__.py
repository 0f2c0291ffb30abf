"""Programs that run the scheduler's code outside the serving loop (python -m scheduler_proc.tools.NAME)."""
