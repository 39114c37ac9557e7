"""Evaluation: held-out ODE samples scored during training and by `imagerl eval` (held_out), and the benchmark
suites with their statistics (suites/)."""
