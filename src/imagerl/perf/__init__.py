"""Performance accounting and `imagerl bench`: analytic FLOP counts for MFU (flops, counted_flops), the
released-size random-weight models (real_size), the upstream-style baselines measured beside imagerl in the same
process (baseline, baseline21, bench_sd3, bench_flux), profiling (profile) and the memory estimate (memory_estimate)."""
