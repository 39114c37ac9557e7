"""`imagerl bench`'s records: one measured iteration (iteration_record), one variant's row of means and MFU
(make_row, Row) and the markdown table of rows (format_table)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Row:
    name: str
    rollout_images_per_s: float
    train_pairs_per_s: float
    images_per_s: float  # end to end: whole iterations
    rollout_mfu: float
    train_mfu: float  # recompute counted as work when gradient checkpointing is on
    peak_gib: float
    log_prob_mean_abs_diff: float  # first optimizer step of each iteration: the weights are the rollout's
    rollout_s: float
    reward_wait_s: float
    train_s: float
    total_s: float
    text_tokens: int
    overrides: list
    per_iteration: list  # the measured iterations' phase times (a compile stall shows up here)
    note: str = ""

    @classmethod
    def failed(cls, name: str, overrides: list, note: str) -> "Row":
        """A variant that did not run to the end (out of memory, a compile error): NaN figures and why."""
        nan = float("nan")
        return cls(name, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, 0, list(overrides), [], note=note)

    @classmethod
    def out_of_memory(cls, name: str, overrides: list) -> "Row":
        return cls.failed(name, overrides, "out of memory")


def iteration_record(phases: dict[str, float], peak_gib: float, lp_diff: float, text_tokens: int,
                     alloc_retries: int = 0) -> dict:
    """One measured iteration: phase seconds (PhaseTimer's time/<phase>_s keys) and the garbage-collection pauses
    within them (perf/gc_*), peak memory, replay difference, the allocator's retries during it."""
    return dict(rollout_s=phases["time/rollout_s"], reward_s=phases["time/reward_s"], train_s=phases["time/train_s"],
                total_s=phases["time/total_s"], peak_gib=peak_gib, lp_diff=lp_diff, text_tokens=text_tokens,
                alloc_retries=alloc_retries, gc_pause_s=phases["perf/gc_pause_s"],
                gc_full_collections=phases["perf/gc_full_collections"])


def make_row(name, overrides, times: list[dict], flops_rollout: int, flops_train: int, ceiling: float, images: int,
             pairs: int, text_tokens: int) -> Row:
    mean = {k: statistics.fmean(t[k] for t in times) for k in times[0]}
    return Row(name=name, rollout_images_per_s=images / mean["rollout_s"], train_pairs_per_s=pairs / mean["train_s"],
               images_per_s=images / mean["total_s"],
               rollout_mfu=flops_rollout / mean["rollout_s"] / ceiling if flops_rollout else float("nan"),
               train_mfu=flops_train / mean["train_s"] / ceiling if flops_train else float("nan"),
               peak_gib=max(t["peak_gib"] for t in times), log_prob_mean_abs_diff=max(t["lp_diff"] for t in times),
               rollout_s=mean["rollout_s"], reward_wait_s=mean["reward_s"], train_s=mean["train_s"],
               total_s=mean["total_s"], text_tokens=text_tokens, overrides=list(overrides), per_iteration=times)


def format_table(rows: list[Row], baseline: Row | None) -> str:
    head = ("variant", "rollout img/s", "train pairs/s", "e2e img/s", "x baseline", "MFU roll", "MFU train",
            "peak GiB", "lp diff")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        ratio = r.images_per_s / baseline.images_per_s if baseline else float("nan")
        if r.note:
            lines.append(" | ".join([r.name, r.note] + [""] * (len(head) - 2)))
            continue
        lines.append(" | ".join([r.name, f"{r.rollout_images_per_s:.3f}", f"{r.train_pairs_per_s:.3f}",
                                 f"{r.images_per_s:.3f}", f"{ratio:.2f}", f"{r.rollout_mfu:.1%}", f"{r.train_mfu:.1%}",
                                 f"{r.peak_gib:.1f}", f"{r.log_prob_mean_abs_diff:.2g}"]))
    return "\n".join(lines)
