"""The algorithm contract (imagerl/algorithms/base.py), checked for every registered algorithm on the tiny
quickstart-recipe model (tests/tiny_recipe.yaml): lr 0 moves nothing; a resume mid-run is bit-exact; 1 and 2 gloo
processes agree (the LoRA within 1e-6 after two rollouts at lr 1e-4, the bound and its reason in
tests/test_distributed.py); a non-finite loss stops the run with the last checkpoint intact; every metric it logs is
documented in docs/metrics.md. A new algorithm registered with @register_algorithm is picked up here unchanged."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config
from imagerl.algorithms.base import Algorithm, NonFiniteError
from imagerl.algorithms.registry import ALGORITHMS, algorithm_class, algorithm_names, register_algorithm
from imagerl.run.checkpoint import verify_checkpoint
from imagerl.train import train

NAMES = algorithm_names()
COMMON = ["sample.prompts_per_rollout=2", "sample.group_size=2", "sample.batch_size=2", "sample.height=64",
          "sample.width=64", "train.num_rollouts=2", "run.checkpoint_every=1", "run.keep_checkpoints=2",
          "train.num_optimizer_steps=2"]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trainer_state(run_dir, step):
    """Every tensor a checkpoint holds (the policy's LoRA, the optimizer, the algorithm's states)."""
    directory = run_dir / "checkpoints" / f"step_{step:06d}"
    return {f"{f.relative_to(directory)}:{k}": v for f in sorted(directory.rglob("*.safetensors"))
            for k, v in load_file(f).items()}


def test_the_bundled_algorithms_are_registered_with_the_contract():
    assert {"flow_grpo", "diffusion_nft"} <= set(NAMES)
    for name in NAMES:
        cls = algorithm_class(name)
        assert issubclass(cls, Algorithm) and cls.name == name and cls.rollout in ("sde", "clean")
    with pytest.raises(ValueError, match="train.algorithm must be one of .*flow_grpo"):
        algorithm_class("ppo")


def test_a_registered_algorithm_is_accepted_by_the_config_check(tiny_checkpoint, tmp_path):
    from imagerl.validation import validate

    @register_algorithm
    class Echo(algorithm_class("flow_grpo")):
        name = "test_echo"

    try:
        validate(tiny_config(tiny_checkpoint, tmp_path, "train.algorithm=test_echo"))
    finally:
        ALGORITHMS.pop("test_echo")
    with pytest.raises(ValueError, match="rollout must be 'sde' or 'clean'"):
        register_algorithm(type("Bad", (Echo,), {"name": "bad", "rollout": "video"}))


@pytest.mark.parametrize("name", NAMES)
def test_lr_zero_moves_nothing(tiny_checkpoint, tmp_path, name):
    """At lr 0 (and no weight decay) two rollouts leave the policy, its optimizer-free states and every export
    where they started: checkpoint 1 equals checkpoint 2 in every LoRA tensor, and both equal a fresh LoRA."""
    from imagerl.components import load_adapter
    from imagerl.distributed.parallel import World

    cfg = tiny_config(tiny_checkpoint, tmp_path, *COMMON, f"train.algorithm={name}", "train.lr=0",
                      "train.weight_decay=0")
    train(cfg)
    first, second = _trainer_state(tmp_path, 1), _trainer_state(tmp_path, 2)
    lora_keys = [k for k in first if "lora_" in k and ":optim/" not in k]  # Adam's moments do move
    assert lora_keys and all(torch.equal(first[k], second[k]) for k in lora_keys)
    fresh = load_adapter(tiny_config(tiny_checkpoint, tmp_path / "fresh", *COMMON), World(0, 1, torch.device("cpu")))
    exported = load_file(tmp_path / "checkpoints" / "step_000002" / "lora" / "adapter_model.safetensors")
    initial = fresh.lora_state_dict()
    assert len(exported) == len(initial)
    for key, value in initial.items():
        assert torch.equal(exported["base_model.model." + key], value), key


@pytest.mark.parametrize("name", NAMES)
def test_a_resume_mid_run_continues_bit_for_bit(tiny_checkpoint, tmp_path, name):
    overrides = [*COMMON, f"train.algorithm={name}", "train.num_rollouts=3", "train.lr=1e-3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config(tiny_checkpoint, straight, *overrides))
    train(tiny_config(tiny_checkpoint, resumed, *overrides, "train.num_rollouts=1"))
    train(tiny_config(tiny_checkpoint, resumed, *overrides), resume="latest")

    def comparable(records):
        # wall-clock and host measurements differ run to run; gc_full_collections counts the GC freeze of a
        # process's first rollout, which a resumed process takes again
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "perf/"))} for r in records]

    assert comparable(_records(straight)) == comparable(_records(resumed))
    a, b = _trainer_state(straight, 3), _trainer_state(resumed, 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", NAMES)
def test_a_non_finite_loss_stops_the_run_with_the_last_checkpoint_intact(tiny_checkpoint, tmp_path, monkeypatch,
                                                                         name):
    """The second update's training forwards return NaN velocities (whatever the algorithm makes of them, its loss
    is then NaN): NonFiniteError before the optimizer step, and checkpoint 1 stays the only and a valid one."""
    from imagerl.families.qwen_image import QwenImageFamily

    cls = algorithm_class(name)
    updates = {"n": 0}
    real_update, real_velocity = cls.update, QwenImageFamily.velocity

    def counting_update(self, *args, **kwargs):
        updates["n"] += 1
        return real_update(self, *args, **kwargs)

    def poisoned_velocity(self, *args, **kwargs):
        v = real_velocity(self, *args, **kwargs)
        return v * float("nan") if updates["n"] == 2 and torch.is_grad_enabled() else v

    monkeypatch.setattr(cls, "update", counting_update)
    monkeypatch.setattr(QwenImageFamily, "velocity", poisoned_velocity)
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"rollout 2: the loss or its gradient is not finite"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, f"train.algorithm={name}"))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"]
    verify_checkpoint(run_dir / "checkpoints" / "step_000001")
    assert len(_records(run_dir)) == 1


def _documented_metric_patterns() -> list[re.Pattern]:
    """Each backticked metric name in docs/metrics.md's tables as a pattern: `<name>` stands for one path
    component, and a name without a '/' after a full one in the same cell shares its prefix
    (`train/adaptive_weight_pos`, `adaptive_weight_neg`)."""
    text = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    patterns = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cell = line.split("|")[1]
        prefix = ""
        for name in re.findall(r"`([^`]+)`", cell):
            if "/" in name:
                prefix = name.rsplit("/", 1)[0] + "/"
            elif prefix:
                name = prefix + name
            else:
                continue
            patterns.append(re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(name).replace(r"\<", "<")
                                              .replace(r"\>", ">")) + "$"))
    return patterns


@pytest.mark.parametrize("name", NAMES)
def test_every_logged_metric_is_documented(tiny_checkpoint, tmp_path, name):
    train(tiny_config(tiny_checkpoint, tmp_path, *COMMON, f"train.algorithm={name}", "train.num_rollouts=1",
                      "eval.interval=1", "data.test_prompts=split", "eval.max_prompts=2", "eval.num_steps=2"))
    patterns = _documented_metric_patterns()
    keys = {k for record in _records(tmp_path) for k in record if k != "step"}
    undocumented = sorted(k for k in keys if not any(p.match(k) for p in patterns))
    assert not undocumented, f"not in docs/metrics.md: {undocumented}"
    # the console line's training metrics are logged ones
    shown = algorithm_class(name).console_metrics(tiny_config(tiny_checkpoint, tmp_path, *COMMON,
                                                              f"train.algorithm={name}"))
    assert "train/grad_norm" in shown and set(shown) <= keys


def test_flow_grpo_shows_clipfrac_and_approx_kl_only_where_they_can_move(tiny_checkpoint, tmp_path):
    """One optimizer step per rollout is on-policy: clipfrac and approx_kl are 0 exactly, so the console shows the
    loss, grad_norm and the replay's log-prob difference; with more steps clipfrac and approx_kl as well."""
    def console(*overrides):
        cfg = tiny_config(tiny_checkpoint, tmp_path, "train.algorithm=flow_grpo", *overrides)
        return algorithm_class("flow_grpo").console_metrics(cfg)

    assert console("train.num_optimizer_steps=1") == ("train/loss", "train/grad_norm", "train/log_prob_mean_abs_diff")
    assert {"train/loss", "train/clipfrac", "train/approx_kl"} <= set(console("train.num_optimizer_steps=2"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", NAMES)
def test_one_and_two_gloo_processes_agree(tiny_checkpoint, tmp_path, name):
    from test_distributed import _lora, _max_diff, _run

    one, two = tmp_path / "w1", tmp_path / "w2"
    _run(1, tiny_checkpoint, one, f"train.algorithm={name}")
    _run(2, tiny_checkpoint, two, f"train.algorithm={name}")
    r1, r2 = _records(one), _records(two)
    assert [r["step"] for r in r1] == [r["step"] for r in r2] == [1, 2]
    for a, b in zip(r1, r2):
        for key in ["rollout/reward/raw_mean", "rollout/advantage_abs_mean", "train/loss", "train/grad_norm"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), key
    assert _max_diff(_lora(one, 2), _lora(two, 2)) < 1e-6
