"""A training run's lifecycle around the loop (imagerl/train.py): checkpoints (checkpoint, checkpoint_tensors,
checkpoint_convert, best_checkpoint; load_checks: what every loaded file is checked for), the run directory's lock
and checks (lock), metrics and what a run prints (metrics, console, report), drift monitors (monitors), GC control
(gc_freeze) and the CPU time estimate (cpu_estimate)."""
