"""What a run prints, and where: progress bars only on a terminal, one line per rollout otherwise; only rank 0 of a
multi-process run prints progress and summaries, the other ranks' warnings and errors keep a `[rank N]` prefix."""

from __future__ import annotations

import io
import os
import sys


def interactive() -> bool:
    """Progress bars redraw in place only on a terminal: in a file or a pipe they are a stream of carriage-return
    redraws. IMAGERL_PROGRESS=1 / 0 forces them on / off."""
    forced = os.environ.get("IMAGERL_PROGRESS")
    if forced is not None:
        return forced not in ("0", "", "false", "no")
    return sys.stderr.isatty()


def format_duration(seconds: float) -> str:
    """'42s', '3m05s', '1h02m'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class RankPrefixed(io.TextIOBase):
    """A text stream that writes each complete line to `stream` as '[rank N] line'; progress-bar redraws (text
    with carriage returns) are dropped."""

    def __init__(self, stream, rank: int):
        self.stream, self.prefix, self._pending = stream, f"[rank {rank}] ", ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if "\r" not in line and line.strip():
                self.stream.write(self.prefix + line + "\n")
        self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def quiet_other_ranks() -> None:
    """On ranks other than 0 (torchrun's RANK): standard output (progress, tables, summaries) is dropped, standard
    error keeps warnings and errors with a rank prefix, and the libraries' own progress bars are off."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        return
    sys.stdout = open(os.devnull, "w")
    sys.stderr = RankPrefixed(sys.__stderr__, rank)
    os.environ["IMAGERL_PROGRESS"] = "0"
    quiet_library_progress()


def quiet_library_progress() -> None:
    """Without a terminal (or on ranks other than 0) the libraries' loading bars ("Loading weights") are off too."""
    if interactive():
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    for module in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            __import__(module, fromlist=["disable_progress_bar"]).disable_progress_bar()
        except ImportError:
            pass


# Warnings that say nothing about a user's run (each checked: it fires on every run and asks nothing of the user)
HARMLESS_WARNINGS = (
    # diffusers ModelMixin.to(): the list of modules to keep in float32 is empty, so the cast is exact
    r"There are modules in \w+ that should be kept in float32: \[\]",
    # torch.distributed.checkpoint in one process: that is what imagerl intends there
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a "
    r"single process",
    # FSDP2 (torch >= 2.12) warns once per forward that a block returns a view (Qwen-Image's blocks return slices
    # of the joint text + image sequence): only an in-place op on that view would skip the all-gather, and none
    # follows; tests/test_distributed.py checks 2 ranks against 1 process every CI run
    r"FSDP2-wrapped module \(.*\) returned a view tensor",
    # transformers >= 5 without torchvision: SD3.5's and FLUX.1's checkpoints name a CLIPImageProcessor (their
    # feature_extractor, which imagerl never calls); the PIL class it falls back to is the one transformers 4 used
    r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to",
    # Inductor on compiled Qwen-Image (2512) blocks: diffusers' RoPE is a complex product, run as an eager kernel
    # inside the compiled graph; the speeds in benchmarks/RESULTS.md include it (Qwen-Image 2.1's blocks take
    # the RoPE as real pairs instead: families/layers/rope_pairs.py)
    r"Torchinductor does not support code generation for complex operators",
)

# Loggers that emit HARMLESS_WARNINGS through logging rather than the warnings module
_HARMLESS_LOGGERS = ("diffusers.models.modeling_utils", "transformers.utils.import_utils")


class _DropHarmless:
    """A logging filter that drops records whose message starts with a HARMLESS_WARNINGS pattern."""

    def filter(self, record) -> bool:
        import re

        return not any(re.match(pattern, record.getMessage()) for pattern in HARMLESS_WARNINGS)


def quiet_harmless_warnings() -> None:
    """Hide the library warnings in HARMLESS_WARNINGS (any other warning still shows)."""
    import warnings

    import logging

    for pattern in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in _HARMLESS_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):
            logger.addFilter(_DropHarmless())
