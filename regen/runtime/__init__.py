"""Run-time services around the loop: checkpoints, metrics sinks, progress display."""
