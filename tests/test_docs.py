"""README.md, docs/ and benchmarks/: the guide stays short, every relative link and #anchor resolves (inline and
reference-style), docs/README.md lists every page, the README's Python (the public API list, the custom-reward
example) runs as written, and benchmarks/RESULTS.md stays the short current table whose numbers all come from the
dated log beside it (benchmarks/LOG.md)."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 375  # issue 50: the README is a guide; reference material lives in docs/ (issue 52: + its evidence;
# issue 53: + the three ways to bring a reward; issue 54: + the new algorithms)
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
LOG = ROOT / "benchmarks" / "LOG.md"
RESULTS_MAX_LINES = 200  # issue 50: one row per recipe and family; the dated runs are in LOG.md


def _without_code(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
    seen = {}
    for line in _without_code(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
            yield s if seen[s] == 0 else f"{s}-{seen[s]}"


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move reference text to docs/"


def _link_targets(text):
    """Inline link targets, then reference-style definitions ([label]: target)."""
    text = _without_code(text)
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, flags=re.M)


def test_relative_links_resolve():
    bad = []
    for page in [README, *sorted(DOCS.glob("*.md")), RESULTS, LOG]:
        text = page.read_text()
        defined = {m.lower() for m in re.findall(r"^\[([^\]]+)\]:", _without_code(text), flags=re.M)}
        for label in re.findall(r"\]\[([^\]]+)\]", re.sub(r"`[^`\n]*`", "", _without_code(text))):
            if label.lower() not in defined:
                bad.append(f"{page.relative_to(ROOT)}: [{label}] is used but not defined")
        for target in _link_targets(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in set(_anchors(dest)):
                bad.append(f"{page.relative_to(ROOT)}: {target} names no heading of {dest.name}")
    assert not bad, "\n".join(bad)


def test_results_is_a_short_table_of_logged_numbers():
    """benchmarks/RESULTS.md: at most RESULTS_MAX_LINES lines, and every decimal number in it (images/s, ratios,
    GiB, lp diffs, rewards) appears in LOG.md: the table summarizes the log, it does not compute new numbers."""
    text = RESULTS.read_text()
    n = len(text.splitlines())
    assert n <= RESULTS_MAX_LINES, f"benchmarks/RESULTS.md has {n} lines (at most {RESULTS_MAX_LINES}): runs go to LOG.md"
    log = LOG.read_text()
    body = re.sub(r"^\[[^\]]+\]:.*$", "", text, flags=re.M)  # not the link definitions' anchors
    numbers = set(re.findall(r"(?<![\w.])\d+\.\d+(?:e-?\d+)?(?!\.?\d)", body))
    missing = sorted(x for x in numbers if not re.search(rf"(?<![\d.]){re.escape(x)}(?![\d])", log))
    assert not missing, f"numbers in benchmarks/RESULTS.md that benchmarks/LOG.md does not have: {missing}"


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
    assert "](docs/README.md)" in README.read_text()


def test_readme_public_api_imports():
    text = README.read_text()
    section = text[text.index("## Public API") :]
    code = _python_blocks(section)[0]
    assert "import" in code
    exec(compile(code, "README.md (Public API)", "exec"), {})


def test_readme_reward_example_runs():
    from imagerl.rewards import REWARDS

    code = next(b for b in _python_blocks(README.read_text()) if "@register_reward(" in b)
    name = re.search(r'@register_reward\("(\w+)"\)', code).group(1)
    assert name not in REWARDS
    try:
        namespace = {}
        exec(compile(code, "README.md (my_rewards.py)", "exec"), namespace)
        from imagerl.config import RewardConfig

        REWARDS[name].check_config(RewardConfig(options={name: {"scale": 1.0}}))
        with pytest.raises(ValueError, match="unknown"):
            REWARDS[name].check_config(RewardConfig(options={name: {"scael": 1.0}}))
        reward = REWARDS[name](RewardConfig(), "cpu")
        images = torch.zeros(2, 3, 8, 8)
        images[0, 0] = 1.0  # the first image pure red, the second black
        values = torch.as_tensor(reward(images, ["a", "b"], [{}, {}]))
        assert values.shape == (2,)
        assert values.tolist() == [1.0, 0.0]
    finally:
        REWARDS.pop(name, None)
