"""Parallelism in one place: the process world and its collectives (parallel), FSDP2 sharding, activation
checkpointing and compile (fsdp), and the seed policy that makes every draw independent of ranks (rng)."""
