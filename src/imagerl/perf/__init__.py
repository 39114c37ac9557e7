"""Performance accounting: analytic FLOP counts (flops.py) for MFU."""
