"""Rewards of one's own without a launcher: reward.plugins (a file outside the package, or a module), reward.options
checked by the reward's check_config, and an entry point of an installed distribution built here (run in a fresh
`python -m imagerl` process, as a user's command would)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from imagerl.cli import main
from imagerl.config import RewardConfig
from imagerl.rewards.registry import Scorer, register_reward
from test_reward_server import QUICK

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_reward_section() -> str:
    text = README.read_text()
    return text[text.index("### Your own reward"):text.index("## Evaluating a model")]


@pytest.fixture
def forget_redness():
    """The README's reward is registered by this test's plugin file; tests/test_docs.py registers it too."""
    from imagerl.rewards import REWARDS, plugins

    yield
    REWARDS.pop("redness", None)
    plugins._loaded.difference_update({p for p in plugins._loaded if p.endswith("my_rewards.py")})


def test_the_readme_plugin_trains_and_evaluates_with_its_options_and_no_launcher(tmp_path, monkeypatch, capsys,
                                                                                 forget_redness):
    section = _readme_reward_section()
    code = re.search(r"```python\n(# my_rewards.py\n.*?)```", section, re.S).group(1)
    commands = re.search(r"\*\*A plugin\*\*.*?```bash\n(.*?)```", section, re.S).group(1).splitlines()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(code)  # a file outside the package, as README says
    train = shlex.split(commands[0])
    assert train[:2] == ["imagerl", "train"] and "reward.plugins=[./my_rewards.py]" in train
    assert main(["train", "--output-dir", "run", *train[2:], *QUICK]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert math_finite(record["rollout/reward/redness_mean"]) and math_finite(record["rollout/reward/shapes_mean"])
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["reward"]
    assert saved["plugins"] == [str(tmp_path / "my_rewards.py")]  # absolute: a resume from elsewhere finds it
    assert saved["options"] == {"redness": {"scale": 2.0}}
    evaluate = shlex.split(commands[1])
    assert evaluate[:2] == ["imagerl", "eval"]
    assert main(["eval", "--max-prompts", "4", "--out", "eval_out", *evaluate[2:]]) == 0
    assert "eval/reward/redness_mean" in json.loads((tmp_path / "eval_out" / "eval.json").read_text())["metrics"]
    # the option reaches the reward: scale 2 doubles the score exactly
    redness = {s: Scorer(RewardConfig(weights={"redness": 1.0}, plugins=["./my_rewards.py"],
                                      options={"redness": {"scale": s}})) for s in (1.0, 2.0)}
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    one, two = (redness[s].score(images, ["p"] * 3, [{}] * 3).total_B for s in (1.0, 2.0))
    assert torch.equal(two, 2 * one) and one.abs().sum() > 0
    # a wrong option is refused by the reward's check_config, in one line, before any model loads
    capsys.readouterr()
    assert main(["train", "--output-dir", "run2", *train[2:], *QUICK, "reward.options.redness.scael=2"]) == 2
    err = capsys.readouterr().err
    assert err == "imagerl: error: reward.options.redness: unknown ['scael']; redness takes scale\n"
    assert not (tmp_path / "run2").exists()


def math_finite(x) -> bool:
    return isinstance(x, float) and x == x and abs(x) != float("inf")


@pytest.mark.parametrize("source, message", [
    ("import torch\nx = torhc.zeros(1)\n",
     r"reward\.plugins: \S+broken_plugin\.py failed to import: NameError: name 'torhc' is not defined "
     r"\(broken_plugin\.py, line 2\)"),
    ("def f(:\n", r"reward\.plugins: \S+broken_plugin\.py failed to import: SyntaxError: .+ \(broken_plugin\.py, line 1\)"),
])
def test_a_plugin_that_fails_to_import_stops_in_one_line_before_any_model_loads(tmp_path, capsys, source, message):
    (tmp_path / "broken_plugin.py").write_text(source)
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *QUICK, f"reward.plugins=[{tmp_path / 'broken_plugin.py'}]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(f"imagerl: error: {message}\n", err), err
    assert not run.exists()


def test_bad_plugin_names_and_options_are_refused_with_what_to_do(tmp_path, capsys):
    for overrides, message in [
        (["reward.plugins=[no_such_module_xyz]"], "reward.plugins: no module named 'no_such_module_xyz'; a module must "
                                                  "be importable (installed, or on PYTHONPATH); a file is given by its "
                                                  "path, e.g. reward.plugins=[./no_such_module_xyz.py]"),
        ([f"reward.plugins=[{tmp_path}/missing.py]"], f"reward.plugins: {tmp_path}/missing.py is not a file"),
        (["reward.weights={mine: 1.0}"], "unknown reward(s) ['mine'] in reward.weights; available: "),
        (["reward.options.nothing_here={a: 1}"], "reward.options.nothing_here: no reward 'nothing_here' is registered"),
        (["reward.remote={shapes: http://127.0.0.1:9}", "reward.options.shapes={a: 1}"],
         "reward.options.shapes: shapes is served by http://127.0.0.1:9; give its options to the server"),
        (["reward.remote={shapes: 127.0.0.1:9}"], "reward.remote.shapes must be a server's URL"),
        (["reward.remote={jpeg_compressibility: http://127.0.0.1:9}"], "reward.remote.jpeg_compressibility: "
                                                                      "jpeg_compressibility is not in reward.weights"),
    ]:
        assert main(["train", "--output-dir", str(tmp_path / "run"), *QUICK, *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith(f"imagerl: error: {message}") and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()
    assert "reward of your own: name the module that registers it in reward.plugins" in _last_unknown(tmp_path, capsys)


def _last_unknown(tmp_path, capsys) -> str:
    main(["train", "--output-dir", str(tmp_path / "run"), *QUICK, "reward.weights={mine: 1.0}"])
    return capsys.readouterr().err


def test_two_rewards_under_one_name_are_refused_naming_both():
    @register_reward("test_twice")
    class First:
        pass

    with pytest.raises(ValueError, match=r"reward 'test_twice' is registered twice: by \S+First and by \S+Second; "
                                         "rename one"):
        @register_reward("test_twice")
        class Second:
            pass


def _install(site: Path, dist: str, module: str, source: str, entry: str) -> None:
    """A distribution as pip installs it: the module and NAME-VERSION.dist-info with METADATA, entry_points.txt and
    RECORD (what importlib.metadata reads)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[imagerl.rewards]\n{entry} = {module}\n")
    (info / "RECORD").write_text(f"{module}.py,,\n{info.name}/METADATA,,\n{info.name}/entry_points.txt,,\n"
                                 f"{info.name}/RECORD,,\n")


def _imagerl(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "imagerl", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_an_installed_entry_point_registers_its_reward_with_no_setting(tmp_path):
    site = tmp_path / "site"
    _install(site, "blue-rewards", "blue_rewards", "import torch\nfrom imagerl.rewards import register_reward\n\n\n"
             "@register_reward('test_ep_blueness')\nclass Blueness:\n    def __init__(self, cfg, device):\n"
             "        pass\n\n    def __call__(self, images, prompts, metadata):\n"
             "        return images[:, 2].mean(dim=(1, 2))\n", "blue")
    done = _imagerl(["eval", "--model", "quickstart", "--prompts", "shapes-test", "--max-prompts", "2", "--reward",
                     "test_ep_blueness", "--out", "out"], site, tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert 0 <= result["metrics"]["eval/reward/test_ep_blueness_mean"] <= 1
    broken = tmp_path / "broken"
    _install(broken, "broken-rewards", "broken_rewards", "raise RuntimeError('needs a GPU driver')\n", "broken")
    done = _imagerl(["eval", "--model", "quickstart", "--prompts", "shapes-test", "--max-prompts", "2"], broken,
                    tmp_path)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("imagerl: note:")]  # busy CPUs
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert errors[0] == ("imagerl: error: the reward plugin broken = broken_rewards (entry point group "
                                  "'imagerl.rewards' of broken-rewards 0.1) failed to import: RuntimeError: needs a "
                                  "GPU driver (broken_rewards.py, line 1); fix or uninstall broken-rewards")


def test_mapping_settings_take_one_entry_and_hold_only_what_json_holds(tmp_path):
    from imagerl.config import load_config

    cfg = load_config("quickstart", ["reward.remote.shapes=http://127.0.0.1:9", "reward.weights.jpeg_compressibility=2",
                                     "reward.options.redness={scale: 2}", "reward.options.redness.when='2024-01-01'",
                                     f"reward.plugins=[{tmp_path}/sub/../mine.py]"])
    assert cfg.reward.weights == {"shapes": 1.0, "jpeg_compressibility": 2.0}
    assert cfg.reward.options == {"redness": {"scale": 2, "when": "2024-01-01"}}
    assert cfg.reward.plugins == [str(tmp_path / "mine.py")]  # one file, one plugin, however it is written
    cleared = load_config("quickstart", ["reward.remote.shapes=http://127.0.0.1:9", "reward.remote.shapes="])
    assert cleared.reward.remote == {}  # `reward.remote.NAME=` removes a served reward: back in process
    with pytest.raises(ValueError, match=r"reward\.options\.redness\.when: datetime\.date\(2024, 1, 1\) is a date; "
                                         r"settings hold text, numbers"):
        load_config("quickstart", ["reward.options.redness.when=2024-01-01"])  # YAML reads a date: JSON cannot


def test_a_missing_import_inside_a_plugin_is_named_as_such(tmp_path, monkeypatch):
    from imagerl.rewards.plugins import load_plugins

    (tmp_path / "my_rewardsx.py").write_text("import my_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"reward\.plugins: my_rewardsx failed to import: ModuleNotFoundError: No "
                                         r"module named 'my_missing_dependency' \(my_rewardsx\.py, line 1\)"):
        load_plugins(["my_rewardsx"])
