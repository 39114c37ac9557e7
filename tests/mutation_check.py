"""Plant each bug of issue 49's table in a copy of src/ and check that the named tests catch it.

    python tests/mutation_check.py                 # every mutation, after a baseline run of the same tests
    python tests/mutation_check.py --only a b      # some of them
    python tests/mutation_check.py --no-baseline   # skip the unmutated run

For each mutation: src/ is copied to a temporary directory, one textual replacement is made there (the pattern must
occur exactly once, so that the script fails loudly when the code moves), the copy is checked to be what
`import imagerl` loads with PYTHONPATH pointing at it, and the mutation's test files run against it. A mutation is
caught when pytest reports failing tests (exit code 1); a pass (0) is "NOT caught", anything else an error. The
baseline runs every named test file once on an unmutated copy: it must pass, or "caught" would mean nothing.
Prints a table; exits non-zero if any mutation is not caught, errs, or the baseline fails.

Not collected by pytest (the name does not start with test_).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    key: str
    what: str
    file: str  # under src/
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, optionally "-k", "expr"


MUTATIONS = [
    Mutation("a", "ppo_clip_loss: upper clip 1 + eps -> 1 + 2 eps", "imagerl/algorithms/flow_grpo.py",
             "clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)",
             "clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + 2 * clip_range)",
             ("tests/test_policy_loss_reference.py", "tests/test_flow_grpo_update_reference.py")),
    Mutation("b", "flow_grpo_update: + beta * KL -> - beta * KL", "imagerl/algorithms/flow_grpo.py",
             "loss = policy_B.mean() + t.beta * kl_B.mean()", "loss = policy_B.mean() - t.beta * kl_B.mean()",
             ("tests/test_flow_grpo_update_reference.py",)),
    Mutation("c", "flow_grpo_update: loss / batches per step (not batches x steps)", "imagerl/algorithms/flow_grpo.py",
             "(loss / micro).backward()", "(loss / per_step).backward()",
             ("tests/test_flow_grpo_update_reference.py",)),
    Mutation("d", "checkpoint_tensors.non_finite: isfinite -> isnan (inf passes)", "imagerl/run/checkpoint_tensors.py",
             "not torch.isfinite(t).all()", "torch.isnan(t).any()",
             ("tests/test_checkpoint_safety.py", "tests/test_checkpoint_format.py", "-k", "non_finite and not loss")),
    Mutation("e", "flow_sde_step without - log(std)", "imagerl/sampling/sde.py",
             "/ (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI", "/ (2 * std**2) - _LOG_SQRT_2PI",
             ("tests/test_sde.py",)),
    Mutation("f", "group_advantages: global std population -> sample", "imagerl/algorithms/advantages.py",
             "rewards.to(torch.float64).std(correction=0) if global_std",
             "rewards.to(torch.float64).std(correction=1) if global_std",
             ("tests/test_advantages.py",)),
    Mutation("g", "nft_loss: adaptive weight averaged over the batch", "imagerl/algorithms/diffusion_nft.py",
             ".abs().mean(dim=dims, keepdim=True).clamp(min=weight_min)",
             ".abs().mean(dim=dims, keepdim=True).mean(dim=0, keepdim=True).clamp(min=weight_min)",
             ("tests/test_diffusion_nft.py",)),
    Mutation("h", "awm_loss: the advantage scaling A / c dropped (clip only)", "imagerl/algorithms/awm.py",
             "return advantages_B.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max",
             "return advantages_B.clamp(-adv_clip_max, adv_clip_max)",
             ("tests/test_awm.py",)),
    Mutation("i", "dppo_loss: the mask drops corrective updates (ratio < 1 with A > 0)", "imagerl/algorithms/dppo.py",
             "dropped = (high & (ratio > 1.0) & (advantages > 0))", "dropped = (high & (ratio < 1.0) & (advantages > 0))",
             ("tests/test_dppo.py",)),
]


def copy_src(directory: Path) -> Path:
    src = directory / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


def mutate(src: Path, m: Mutation) -> None:
    path = src / m.file
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"mutation {m.key}: {m.old!r} occurs {count} times in src/{m.file} (expected once): "
                         "the code moved; update tests/mutation_check.py")
    path.write_text(text.replace(m.old, m.new))


def environment(src: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONDONTWRITEBYTECODE="1")
    loaded = subprocess.run([sys.executable, "-c", "import imagerl; print(imagerl.__file__)"], env=env, cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    if Path(loaded).resolve() != (src / "imagerl" / "__init__.py").resolve():
        raise SystemExit(f"with PYTHONPATH={src} imagerl is imported from {loaded}, not the copy")
    return env


def run_pytest(src: Path, args: tuple[str, ...]) -> tuple[int, str, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          env=environment(src), cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else done.stderr.strip()[-200:], time.perf_counter() - start


def baseline_args(mutations: list[Mutation]) -> list[tuple[str, ...]]:
    """The mutations' test files in as few runs as possible: one per distinct -k filter (or none)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for m in mutations:
        cut = m.tests.index("-k") if "-k" in m.tests else len(m.tests)
        files = groups.setdefault(m.tests[cut:], [])
        files += [f for f in m.tests[:cut] if f not in files]
    return [(*files, *k) for k, files in groups.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutation keys (a b ...)")
    parser.add_argument("--no-baseline", action="store_true")
    options = parser.parse_args()
    chosen = [m for m in MUTATIONS if not options.only or m.key in options.only]
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="imagerl-mutation-") as tmp:
        if not options.no_baseline:
            src = copy_src(Path(tmp) / "baseline")
            for args in baseline_args(chosen):
                code, last, seconds = run_pytest(src, args)
                status = "passes" if code == 0 else f"FAILS (exit {code})"
                ok &= code == 0
                rows.append(("-", "baseline (no mutation)", " ".join(args), status, seconds, last))
        for m in chosen:
            src = copy_src(Path(tmp) / m.key)
            mutate(src, m)
            code, last, seconds = run_pytest(src, m.tests)
            status = {0: "NOT caught", 1: "caught"}.get(code, f"error (exit {code})")
            ok &= code == 1
            rows.append((m.key, m.what, " ".join(m.tests), status, seconds, last))
    print("| mutation | | tests | result | s | pytest |")
    print("|---|---|---|---|---|---|")
    for key, what, tests, status, seconds, last in rows:
        print(f"| {key} | {what} | {tests} | {status} | {seconds:.0f} | {last} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
