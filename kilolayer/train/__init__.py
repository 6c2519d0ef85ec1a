"""Training: the loop, optimiser and schedules, checkpoints, multi-process, logging, diagnostics."""
