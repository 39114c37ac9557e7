"""data.mixture: several prompt sets with their own rewards and shares (imagerl.data.mixture). The composition against
the largest-remainder rule worked by hand, the sampler's slices and passes, the Scorer's per-set rewards against a
direct computation, per-reward advantages over the images each reward scored against a float64 loop, and a
training run's per-set metrics."""

import json
import math

import pytest
import torch

from conftest import tiny_config
from imagerl.config import load_config
from imagerl.data.mixture import MIXTURE_KEY, MixtureSampler, check_mixture, load_mixture, set_counts


@pytest.mark.parametrize("shares, total, expected", [
    ([1, 1], 3, [2, 1]),           # 1.5 / 1.5: equal remainders, the earlier set first
    ([0.5, 0.3, 0.2], 10, [5, 3, 2]),
    ([1, 2], 4, [1, 3]),           # 1.33 / 2.67: floors 1 + 2, the larger remainder (0.67) takes the last
    ([3, 1], 16, [12, 4]),
])
def test_set_counts_follow_the_largest_remainder(shares, total, expected):
    assert set_counts(shares, total) == expected and sum(expected) == total


def _mixture_cfg(tmp_path, *overrides, sets=None):
    other = tmp_path / "other.txt"
    other.write_text("".join(f"a photo number {i}\n" for i in range(5)))
    sets = sets or (f'[{{name: shapes, prompts: shapes-train, share: 3, rewards: {{shapes: 1.0}}}}, '
                    f'{{name: other, prompts: {other}, share: 1, rewards: {{jpeg_compressibility: 2.0}}}}]')
    return load_config("quickstart", ["sample.prompts_per_rollout=4", "data.test_prompts=", f"data.mixture={sets}",
                                      *overrides])


def test_bad_mixtures_are_refused_with_what_to_change(tmp_path):
    cfg = _mixture_cfg(tmp_path)
    check_mixture(cfg)
    assert cfg.reward.weights == {"shapes": 1.0, "jpeg_compressibility": 1.0}  # what loads: the union
    bad = {
        "[{name: a, prompts: shapes-train, rewards: {shapes: 1}}, {name: a, prompts: shapes-train, rewards: {shapes: 1}}]":
            "used by two sets",
        "[{name: 'a b', prompts: shapes-train, rewards: {shapes: 1}}]": "letters, digits",
        "[{name: a, prompts: shapes-train, share: 0, rewards: {shapes: 1}}]": "share must be > 0",
        "[{name: a, prompts: shapes-train, rewards: {}}]": "rewards is empty",
        "[{name: a, prompts: shapes-train, rewards: {nope: 1}}]": "nope",
        "[{name: a, prompts: '', rewards: {shapes: 1}}]": "prompts is empty",
        "[{name: a, prompts: shapes-train, share: 100, rewards: {shapes: 1}}, "
        "{name: b, prompts: shapes-train, share: 1, rewards: {shapes: 1}}]": r"set 'b' \(share 1\) gets no prompt",
    }
    for sets, message in bad.items():
        with pytest.raises(ValueError, match=message):
            check_mixture(_mixture_cfg(tmp_path, sets=sets))
    with pytest.raises(ValueError, match="remove data.test_prompts"):
        check_mixture(_mixture_cfg(tmp_path, "data.test_prompts=shapes-test"))
    with pytest.raises(ValueError, match=r"data.mixture\[0\].foo: unknown key|unknown key 'foo'"):
        load_config("quickstart", ["data.mixture=[{name: a, foo: 1}]"])


def test_the_sampler_gives_each_set_its_share_in_whole_groups_and_each_pass_covers_a_set(tmp_path):
    cfg = _mixture_cfg(tmp_path)
    check_mixture(cfg)
    train, test = load_mixture(cfg.data)
    assert test is None and {m[MIXTURE_KEY] for m in train.metadata} == {"shapes", "other"}
    one = MixtureSampler(train, ["shapes", "other"], [3, 1], seed=7)
    for step in range(5):
        groups = one.groups_for(step)
        assert [m[MIXTURE_KEY] for m in groups.metadata_G] == ["shapes"] * 3 + ["other"]
        assert groups.group_ids_G == [0, 1, 2, 3]
        # two ranks: contiguous halves of the same global list
        halves = [MixtureSampler(train, ["shapes", "other"], [3, 1], seed=7, rank=r, world_size=2).groups_for(step)
                  for r in range(2)]
        assert halves[0].prompts_G + halves[1].prompts_G == groups.prompts_G
        assert halves[1].group_ids_G == [2, 3]
    # the 5 "other" prompts, one per rollout: rollouts 0-4 draw each once, in a seeded order
    drawn = [one.groups_for(step).prompts_G[3] for step in range(5)]
    assert sorted(drawn) == [f"a photo number {i}" for i in range(5)]
    assert [MixtureSampler(train, ["shapes", "other"], [3, 1], seed=8).groups_for(s).prompts_G[3]
            for s in range(5)] != drawn  # another seed, another order
    with pytest.raises(ValueError, match="divisible by world_size"):
        MixtureSampler(train, ["shapes", "other"], [3, 1], seed=7, world_size=3)


def test_each_image_is_scored_by_its_own_sets_rewards_only(tmp_path):
    from imagerl.config import RewardConfig
    from imagerl.rewards import Scorer
    from imagerl.rewards.jpeg import jpeg_sizes_kb

    prompts = ["a red circle", "a photo number 1", "a blue square", "a photo number 2"]
    metadata = [{MIXTURE_KEY: s} for s in ("shapes", "other", "shapes", "other")]
    images = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    scorer = Scorer(RewardConfig(weights={"shapes": 1.0, "jpeg_compressibility": 1.0}), "cpu",
                    set_weights={"shapes": {"shapes": 1.0}, "other": {"jpeg_compressibility": 2.0}})
    # the shapes reward refuses "a photo number 1": validating and scoring must never show it those prompts
    scorer.validate_prompts(prompts, metadata)
    batch = scorer.score(images, prompts, metadata)
    shapes = Scorer(RewardConfig(weights={"shapes": 1.0}), "cpu").score(images[[0, 2]], prompts[0::2], metadata[0::2])
    jpeg = -jpeg_sizes_kb(images[[1, 3]]).double() / 500
    assert torch.equal(batch.components["shapes"][[0, 2]], shapes.total_B)
    assert batch.components["shapes"][[1, 3]].isnan().all() and batch.components["jpeg_compressibility"][[0, 2]].isnan().all()
    assert torch.allclose(batch.components["jpeg_compressibility"][[1, 3]], jpeg)
    assert torch.allclose(batch.total_B, torch.stack([shapes.total_B[0], 2 * jpeg[0], shapes.total_B[1], 2 * jpeg[1]]))
    assert batch.valid_B.all()
    with pytest.raises(ValueError, match="a photo number 1"):
        Scorer(RewardConfig(weights={"shapes": 1.0}), "cpu").validate_prompts(prompts, metadata)


def test_per_reward_advantages_of_a_mixture_against_a_float64_loop():
    """Two sets: groups 0-1 scored by reward a (weight 1), groups 2-3 by b (weight 3) and a (weight 0.5). Each set's
    advantages are computed over its own samples: one reward (set 0) is GRPO on the weighted reward, two (set 1) are
    GDPO (each reward's group advantage over the set's global std, weighted, summed, batch-normalised)."""
    from imagerl.algorithms.advantages import rollout_advantages
    from imagerl.distributed.parallel import World

    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    sets = torch.tensor([0] * 6 + [1] * 6)
    a = torch.tensor([1.0, 2.0, 4.0, 0.5, 0.5, 1.5, 3.0, 1.0, 2.0, 0.0, 2.0, 7.0], dtype=torch.float64)
    b = torch.tensor([math.nan] * 6 + [10.0, 30.0, 20.0, 5.0, 5.0, 35.0], dtype=torch.float64)
    wa = torch.tensor([1.0] * 6 + [0.5] * 6, dtype=torch.float64)
    wb = torch.tensor([0.0] * 6 + [3.0] * 6, dtype=torch.float64)
    total = wa * a + torch.nan_to_num(wb * b)
    got, _ = rollout_advantages(total, torch.ones(12, dtype=torch.bool), g, World(0, 1, torch.device("cpu")), True,
                                {"a": a, "b": b}, {"a": wa, "b": wb}, sets)

    def advantages(values, samples):
        vals = [values[i] for i in samples]
        mean_all = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean_all) ** 2 for v in vals) / len(vals))
        out = {}
        for i in samples:
            group = [values[j] for j in samples if g[j] == g[i]]
            out[i] = (values[i] - sum(group) / len(group)) / (std + 1e-4)
        return out

    set0 = advantages([wa[i].item() * a[i].item() for i in range(12)], range(6))
    adv_a, adv_b = advantages(a.tolist(), range(6, 12)), advantages(b.tolist(), range(6, 12))
    pre = [0.5 * adv_a[i] + 3.0 * adv_b[i] for i in range(6, 12)]
    mean = sum(pre) / 6
    std = math.sqrt(sum((p - mean) ** 2 for p in pre) / 5)
    expected = [set0[i] for i in range(6)] + [(p - mean) / (std + 1e-4) for p in pre]
    assert got.double().tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)  # the advantages come back float32


def test_training_on_a_mixture_logs_each_set(tiny_checkpoint, tmp_path):
    """Two rollouts of the tiny model on two sets (3 + 1 prompts per rollout) with per-reward advantages, each set
    evaluated on its own held-out prompts: rollout/set/<name>/* and eval/set/<name>/* are logged, each set's
    component is absent from the other's, and the rollout's mean is the sets' means weighted by their images."""
    from imagerl.train import train

    other = tmp_path / "other.txt"
    other.write_text("".join(f"a photo number {i}\n" for i in range(5)))
    held_out = tmp_path / "other_test.txt"
    held_out.write_text("a photo number 9\n")
    sets = (f"[{{name: shapes, prompts: shapes-train, share: 3, rewards: {{shapes: 1.0}}, test_prompts: shapes-test}}, "
            f"{{name: other, prompts: {other}, share: 1, rewards: {{jpeg_compressibility: 2.0}}, "
            f"test_prompts: {held_out}}}]")
    run = tmp_path / "run"
    train(tiny_config(tiny_checkpoint, run, "sample.prompts_per_rollout=4", "sample.batch_size=4", f"data.mixture={sets}",
                      "train.advantage=per_reward", "eval.interval=2", "eval.num_steps=2", "eval.batch_size=32", "eval.max_prompts=0",
                      "sample.guidance_scale=1"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert {"rollout/set/shapes/raw_mean", "rollout/set/shapes/shapes_mean", "rollout/set/other/raw_mean",
            "rollout/set/other/jpeg_compressibility_mean", "eval/set/shapes/raw_mean", "eval/set/other/raw_mean"} <= set(last)
    assert "rollout/set/shapes/jpeg_compressibility_mean" not in last and "rollout/set/other/shapes_mean" not in last
    assert last["rollout/set/other/raw_mean"] == pytest.approx(2 * last["rollout/set/other/jpeg_compressibility_mean"])
    mixed = (3 * last["rollout/set/shapes/raw_mean"] + last["rollout/set/other/raw_mean"]) / 4
    assert last["rollout/reward/raw_mean"] == pytest.approx(mixed, rel=1e-9)
    assert last["rollout/reward/failed_count"] == 0 and last["train/log_prob_mean_abs_diff"] == 0.0
    from imagerl.run.report import write_report

    report, _ = write_report(run, phases=False)
    assert "held-out set other" in report and "held-out set shapes" in report and "shapes_mean" in report


def test_held_out_prompts_alternate_between_the_sets_so_max_prompts_keeps_every_set(tmp_path):
    """eval.max_prompts takes the held-out list's first entries: with the sets' lists interleaved prompt by prompt
    (each prompt's test_samples_per_prompt samples together) a short evaluation still scores every set."""
    other, held_out = tmp_path / "other.txt", tmp_path / "other_test.txt"
    other.write_text("a photo number 0\n")
    held_out.write_text("a photo number 8\na photo number 9\n")
    sets = (f"[{{name: shapes, prompts: shapes-train, share: 3, rewards: {{shapes: 1.0}}, test_prompts: shapes-test}}, "
            f"{{name: other, prompts: {other}, share: 1, rewards: {{jpeg_compressibility: 2.0}}, "
            f"test_prompts: {held_out}}}]")
    cfg = _mixture_cfg(tmp_path, "data.test_samples_per_prompt=2", sets=sets)
    _, test = load_mixture(cfg.data)
    tags = [m[MIXTURE_KEY] for m in test.metadata]
    assert tags[:8] == ["shapes", "shapes", "other", "other", "shapes", "shapes", "other", "other"]
    assert test.prompts[2:4] == ["a photo number 8"] * 2 and test.prompts[6:8] == ["a photo number 9"] * 2
    assert test.prompts[0] == test.prompts[1] != test.prompts[4]
    assert tags[8:] == ["shapes"] * (len(tags) - 8) and tags.count("other") == 4


def _readme_command(marker: str) -> list[str]:
    """The README's ```bash block that contains `marker`, as the shell would split it (continuation lines joined)."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if marker in b)
    return shlex.split(block.replace("\\\n", " "))


def test_the_readme_mixture_example_trains_evaluates_and_reports(tmp_path, capsys):
    """README's data.mixture command verbatim (a set without test_prompts), shortened to one rollout and 4 held-out
    prompts: training, the evaluation of the set that has held-out prompts, the closing tables and `imagerl report`
    all succeed. Before: the closing table formatted the unevaluated set's reward (logged as null) and crashed."""
    from imagerl.cli import main

    argv = _readme_command("data.mixture=")
    assert argv[:2] == ["imagerl", "train"] and "data.test_prompts=" in argv
    run = tmp_path / "mixture"
    assert argv.count("--output-dir") == 1 and argv[argv.index("--output-dir") + 1].startswith("runs/")
    argv = [a if not a.startswith("runs/") else str(run) for a in argv[1:]]  # --output-dir into tmp_path
    assert main([*argv, "train.num_rollouts=1", "eval.interval=1", "eval.max_prompts=4", "eval.suites=[]",
                 "sample.prompts_per_rollout=4", "run.checkpoint_every=1"]) == 0
    out = capsys.readouterr().out
    assert "held-out evaluation" in out and "held-out set shapes" in out and "held-out set jpeg" not in out
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert "eval/set/shapes/raw_mean" in last and "eval/reward/jpeg_incompressibility_mean" not in last
    assert main(["report", str(run)]) == 0
    assert "held-out set shapes" in capsys.readouterr().out


def test_the_eval_table_shows_a_missing_component_as_a_dash():
    from imagerl.run.report import format_eval_table

    records = [{"step": 0, "eval/reward/raw_mean": 0.5, "eval/reward/a_mean": 0.5, "eval/reward/b_mean": None},
               {"step": 1, "eval/reward/raw_mean": 0.6, "eval/reward/a_mean": 0.6}]
    table = format_eval_table(records)
    assert table.splitlines()[2].split() == ["0", "0.5000", "0.5000", "-"]
    assert table.splitlines()[3].split() == ["1", "0.6000", "0.6000", "-"]
