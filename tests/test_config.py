"""Recipes, dotted overrides, up-front validation and the batch arithmetic (imagerl.config)."""

import dataclasses

import pytest
import yaml

from imagerl.config import Config, available_recipes, load_config, recipe_dir, save_config
from imagerl.validation import BatchPlan, validate

# Pins the sizes the validation cases below rely on, so that retuning the quickstart recipe cannot break them.
BASE = ["train.algorithm=flow_grpo", "sample.prompts_per_rollout=4", "sample.group_size=4", "sample.batch_size=4", "train.num_optimizer_steps=2",
        "sample.num_steps=10", "sample.num_sde_steps=2", "sample.sde_window_range=[0,5]", "sample.sde_window_start=3"]


def config(*overrides):
    return load_config("quickstart", BASE + list(overrides))


def plan_by_hand(prompts, group, batch, opt_steps, world):
    """BatchPlan from first principles: P x K samples, split over ranks, into batches, into optimizer steps."""
    samples = prompts * group
    per_rank = samples // world
    batches = per_rank // batch
    return dict(samples_per_rollout=samples, prompts_per_rank=prompts // world, samples_per_rank=per_rank,
                batches_per_rank=batches, batches_per_optimizer_step=batches // opt_steps,
                samples_per_optimizer_step=samples // opt_steps)


# ---------------------------------------------------------------- bundled recipes


def test_bundled_recipes_include_quickstart_and_the_qwen_image_recipe():
    assert {"quickstart", "qwen_image_jpeg"} <= set(available_recipes())


@pytest.mark.parametrize("name", available_recipes())
def test_every_bundled_recipe_loads_and_validates(name):
    cfg = load_config(name)
    assert cfg.recipe == name
    plan = validate(cfg, world_size=1)
    assert isinstance(plan, BatchPlan)
    # every key of the YAML file reached the config (nothing silently ignored or left at its default)
    raw = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())
    for section, values in raw.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


def test_quickstart_batch_plan_is_what_the_yaml_implies():
    raw = yaml.safe_load((recipe_dir() / "quickstart.yaml").read_text())
    s = raw["sample"]
    opt_steps = raw.get("train", {}).get("num_optimizer_steps", Config().train.num_optimizer_steps)
    expected = plan_by_hand(s["prompts_per_rollout"], s["group_size"], s["batch_size"], opt_steps, world=1)
    plan = validate(load_config("quickstart"), world_size=1)
    assert dataclasses.asdict(plan) == expected


def test_qwen_image_recipe_batch_plan_matches_flow_grpo():
    plan = validate(load_config("qwen_image_jpeg"), world_size=1)
    # 512 samples in training batches of 4: 128 batches, 2 optimizer steps of 256 samples (flow_grpo's 32-GPU recipe)
    assert plan == BatchPlan(samples_per_rollout=512, prompts_per_rank=32, samples_per_rank=512, batches_per_rank=128,
                             batches_per_optimizer_step=64, samples_per_optimizer_step=256)


def test_valid_two_rank_configuration_and_its_plan():
    cfg = config()
    plan = validate(cfg, world_size=2)
    assert dataclasses.asdict(plan) == plan_by_hand(4, 4, 4, 2, world=2)
    assert plan == BatchPlan(16, 2, 8, 2, 1, 8)


# ---------------------------------------------------------------- overrides


def test_lr_in_exponent_notation_is_a_float():
    cfg = load_config("quickstart", ["train.lr=1e-4"])
    assert type(cfg.train.lr) is float and cfg.train.lr == 1e-4


def test_exponent_notation_in_a_recipe_file_and_inside_a_mapping_override(tmp_path):
    """YAML 1.1 reads 1e-4 (no dot) as a string; recipe files and nested override values must still work."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  lr: 1e-4\n  adam_eps: 1E-6\nreward:\n  weights: {jpeg_compressibility: 5e-1}\n")
    cfg = load_config(str(recipe), ["reward.weights={jpeg_incompressibility: 2e-3}", "train.clip_range=-2e-2"])
    assert cfg.recipe == "mine"
    assert type(cfg.train.lr) is float and cfg.train.lr == 1e-4
    assert cfg.train.adam_eps == 1e-6
    assert cfg.train.clip_range == -2e-2
    assert cfg.reward.weights == {"jpeg_incompressibility": 2e-3}
    assert type(cfg.reward.weights["jpeg_incompressibility"]) is float


def test_numeric_looking_strings_stay_strings_for_str_fields():
    cfg = load_config("quickstart", ["sample.negative_prompt=inf", "model.path=1e5"])
    assert cfg.sample.negative_prompt == "inf"
    assert cfg.model.path == "1e5"


def test_list_override():
    cfg = load_config("quickstart", ["sample.sde_window_range=[0,4]"])
    assert cfg.sample.sde_window_range == [0, 4]
    assert all(type(v) is int for v in cfg.sample.sde_window_range)


@pytest.mark.parametrize("raw, expected", [("random", "random"), ("2", 2)])
def test_window_start_int_or_random(raw, expected):
    cfg = load_config("quickstart", [f"sample.sde_window_start={raw}"])
    assert cfg.sample.sde_window_start == expected and type(cfg.sample.sde_window_start) is type(expected)
    validate(cfg)


def test_mapping_override_replaces_the_reward_weights():
    cfg = load_config("quickstart", ["reward.weights={jpeg_incompressibility: 2.0}"])
    assert cfg.reward.weights == {"jpeg_incompressibility": 2.0}


def test_int_for_float_field_is_coerced():
    cfg = load_config("quickstart", ["train.lr=1", "sample.guidance_scale=5", "reward.weights={jpeg_compressibility: 3}"])
    assert type(cfg.train.lr) is float and cfg.train.lr == 1.0
    assert type(cfg.sample.guidance_scale) is float and cfg.sample.guidance_scale == 5.0
    assert type(cfg.reward.weights["jpeg_compressibility"]) is float


def test_overrides_apply_in_order_and_whole_sections_can_be_set():
    cfg = load_config("quickstart", ["train.lr=0.1", "train={lr: 0.2, num_rollouts: 3}", "run.tensorboard=false"])
    assert cfg.train.lr == 0.2 and cfg.train.num_rollouts == 3
    assert cfg.train.num_optimizer_steps == load_config("quickstart").train.num_optimizer_steps \
        != Config().train.num_optimizer_steps
    # (untouched keys of the section keep the recipe's value, not the dataclass default)
    assert cfg.run.tensorboard is False


def test_bundled_recipe_is_not_modified_by_overrides():
    raw = yaml.safe_load((recipe_dir() / "quickstart.yaml").read_text())
    assert load_config("quickstart", ["train.lr=0.5"]).train.lr == 0.5 != raw["train"]["lr"]
    assert load_config("quickstart").train.lr == raw["train"]["lr"]


@pytest.mark.parametrize("override, match", [
    ("train.lrr=1e-4", r"unknown config key 'train.lrr'; did you mean train\.lr\?"),
    ("sampel.group_size=4", r"unknown config key 'sampel.group_size'; did you mean sample\?"),
    ("sample.group_size=abc", r"sample\.group_size: expected int, got 'abc'"),
    ("sample.group_size=2.5", r"sample\.group_size: expected int"),
    ("sample.group_size=true", r"sample\.group_size: expected int, got True"),
    ("train.lr=abc", r"train\.lr: expected float, got 'abc'"),
    ("train.lr=nan", r"train\.lr: expected float"),
    ("sample.sde_window_range=3", r"sample\.sde_window_range: expected a list"),
    ("sample.sde_window_range=[0,a]", r"sample\.sde_window_range\[1\]: expected int"),
    ("reward.weights=[1]", r"reward\.weights: expected a mapping"),
    ("sample.sde_window_start=1.5", r"sample\.sde_window_start: 1\.5 is none of"),
    ("train.lr", r"override 'train\.lr' must look like section\.key=value"),
    ("=3", r"must look like section\.key=value"),
    ("sample=3", r"sample: expected a section \(mapping\), got 3"),
    ("train.lr.x=1", r"train\.lr is not a section"),
    ("sample.sde_window_range=[0,", r"cannot parse value"),
])
def test_bad_overrides_are_value_errors_naming_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_config("quickstart", [override])


def test_unknown_key_lists_the_valid_keys():
    with pytest.raises(ValueError, match=r"valid here: .*group_size"):
        load_config("quickstart", ["sample.xyzzy=1"])


def test_unknown_recipe_lists_the_bundled_ones():
    with pytest.raises(ValueError, match=r"unknown recipe 'quikstart'; bundled recipes: .*quickstart"):
        load_config("quikstart")


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ValueError, match=r"recipe file .*nope\.yaml does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("text, match", [
    ("- a\n- b\n", r"must be a mapping of sections, got list"),
    ("just a string\n", r"must be a mapping of sections, got str"),
    ("train: [unclosed\n", r"is not valid YAML"),
    ("train:\n  lr: fast\n", r"train\.lr: expected float, got 'fast'"),
    ("trian:\n  lr: 0.1\n", r"did you mean train\?"),
])
def test_bad_recipe_files(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config(str(path))


def test_empty_recipe_file_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    cfg = load_config(str(path))
    assert cfg.to_dict() == dataclasses.replace(Config(), recipe="empty").to_dict()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("overrides, world, match", [
    (["sample.prompts_per_rollout=3"], 2, r"prompts_per_rollout=3 must be divisible by the 2 ranks"),
    (["sample.group_size=3", "sample.batch_size=8"], 1, r"= 12 samples, not a multiple of sample\.batch_size=8"),
    (["sample.group_size=3", "sample.batch_size=4"], 2, r"2 x 3 = 6 samples, not a multiple of sample\.batch_size=4"),
    (["train.num_optimizer_steps=3"], 1, r"4 training batches per rank .* cannot be split evenly into train\.num_optimizer_steps=3"),
    (["sample.num_sde_steps=3", "sample.sde_window_range=[0,2]", "sample.sde_window_start=0"], 1,
     r"num_sde_steps=3 does not fit sample\.sde_window_range=\[0, 2\]"),
    (["sample.sde_window_range=[0,10]"], 1, r"0 <= lo < hi <= num_steps - 1 = 9"),
    (["sample.sde_window_range=[3,3]"], 1, r"0 <= lo < hi"),
    (["sample.sde_window_range=[0,1,2]"], 1, r"sde_window_range must be \[lo, hi\]"),
    (["sample.sde_window_start=4"], 1, r"sde_window_start=4 must lie in \[0, 3\]"),
    (["sample.sde_window_start=banana"], 1, r"sde_window_start must be an int or 'random', got 'banana'"),
    (["sample.num_sde_steps=0"], 1, r"num_sde_steps must be >= 1"),
    (["sample.noise_level=0"], 1, r"noise_level must be > 0 .*0 is the ODE"),
    (["train.lr=-1e-4"], 1, r"train\.lr must be a finite number >= 0, got -0\.0001"),
    (["train.clip_range=-1"], 1, r"train\.clip_range must be a finite number >= 0"),
    (["train.lr=.nan"], 1, r"train\.lr must be a finite number >= 0, got nan"),
    (["model.lora_init=pissa"], 1, r"model\.lora_init must be 'gaussian' or 'default'"),
    (["reward.weights={}"], 1, r"reward\.weights is empty"),
    (["reward.on_error=ignore"], 1, r"reward\.on_error must be 'error' or 'skip', got 'ignore'"),
    (["sample.sde_type=ode"], 1, r"sample\.sde_type must be 'sde' or 'cps', got 'ode'"),
    (["model.dtype=float16"], 1, r"model\.dtype must be auto, float32 or bfloat16, got 'float16'"),
    (["model.vae_dtype=float16"], 1, r"model\.vae_dtype must be 'float32' or 'bfloat16', got 'float16'"),
    (["sample.group_size=0"], 1, r"sample\.group_size must be >= 1, got 0"),
    (["sample.batch_size=0"], 1, r"sample\.batch_size must be >= 1"),
    (["model.lora_rank=0"], 1, r"model\.lora_rank must be >= 1"),
    (["run.checkpoint_every=0"], 1, r"run\.checkpoint_every must be >= 1"),
    (["model.checkpoint_every=0"], 1, r"model\.checkpoint_every must be >= 1"),
    ([], 0, r"world_size must be >= 1"),
])
def test_validate_rejects_with_an_informative_message(overrides, world, match):
    cfg = config(*overrides)  # loading succeeds: these are semantic errors
    with pytest.raises(ValueError, match=match):
        validate(cfg, world_size=world)


@pytest.mark.parametrize("overrides, world", [
    (["sample.prompts_per_rollout=3", "sample.group_size=4", "sample.batch_size=2", "train.num_optimizer_steps=3"], 1),
    (["sample.prompts_per_rollout=8", "sample.group_size=2", "sample.batch_size=2", "train.num_optimizer_steps=2"], 4),
    (["sample.sde_window_range=[0,9]", "sample.sde_window_start=7", "sample.noise_level=0.5", "sample.sde_type=cps"], 1),
])
def test_validate_accepts_consistent_settings(overrides, world):
    cfg = config(*overrides)
    s, t = cfg.sample, cfg.train
    plan = validate(cfg, world_size=world)
    assert dataclasses.asdict(plan) == plan_by_hand(s.prompts_per_rollout, s.group_size, s.batch_size,
                                                    t.num_optimizer_steps, world)
    # the plan is self-consistent: every sample of a rank is in exactly one batch of exactly one optimizer step
    assert plan.batches_per_optimizer_step * t.num_optimizer_steps * s.batch_size == plan.samples_per_rank
    assert plan.samples_per_optimizer_step * t.num_optimizer_steps == plan.samples_per_rollout


# ---------------------------------------------------------------- saving


@pytest.mark.parametrize("name", available_recipes())
def test_save_config_round_trips(tmp_path, name):
    cfg = load_config(name, ["train.lr=1e-4", "train.adam_eps=1e-12", "sample.sde_window_start=random",
                             "reward.weights={jpeg_incompressibility: 2.0, jpeg_compressibility: 0.5}",
                             "sample.negative_prompt=no text", "model.lora_target_modules=[to_q, to_k]"])
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    back = load_config(str(path))
    assert back.to_dict() == cfg.to_dict()  # the saved file records the recipe name too
    validate(back)


def test_save_config_round_trips_defaults(tmp_path):
    path = tmp_path / "config.yaml"
    save_config(Config(), path)
    assert load_config(str(path)).to_dict() == Config().to_dict()
    assert yaml.safe_load(path.read_text())["train"]["lr"] == Config().train.lr
