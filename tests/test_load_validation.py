"""What is checked on every load path (tiny checkpoint, CPU): a tensor of a type the model does not use (complex,
integer where floats belong) or a non-finite one is refused on resume (train and sft), `imagerl sample --lora`,
`imagerl eval --lora` and `imagerl sft --export`; an adapter must match the model (every LoRA tensor present, no
other, the same shapes, the rank its config says); a checkpoint's optimizer settings and step counts are the run's
own or refused; and a checkpoint's files are checked before the model loads."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import imagerl.sft.trainer
import imagerl.train
from conftest import tiny_config
from imagerl.cli import main
from imagerl.run.checkpoint_tensors import read_trainer_state
from imagerl.train import train
from test_checkpoint_safety import _rewrite_checksums

COMMON = ["train.num_rollouts=2", "run.checkpoint_every=1", "run.keep_checkpoints=3"]
NAN = float("nan")


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    """A finished 2-rollout run (checkpoints after rollouts 1 and 2), copied by each test that changes it."""
    run_dir = tmp_path_factory.mktemp("load") / "run"
    train(tiny_config(tiny_checkpoint, run_dir, *COMMON))
    return run_dir


def copy_run(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def replace_tensor(file, key_part, make):
    """The first tensor of a safetensors file whose key contains key_part replaced by make(tensor); its key."""
    tensors = load_file(file)
    key = next(k for k in sorted(tensors) if key_part in k)
    tensors[key] = make(tensors[key])
    save_file(tensors, file)
    return key


def first_nan(t):
    t = t.clone()
    t.view(-1)[0] = NAN
    return t


def first_inf(t):
    t = t.clone()
    t.view(-1)[0] = float("inf")
    return t


BAD_TENSORS = {  # each a tensor a careless conversion or an attacker could leave, none of them imagerl's
    "complex-nan": lambda t: torch.full(t.shape, complex(NAN, 0.0), dtype=torch.complex64),
    "complex": lambda t: t.to(torch.complex64),
    "int": lambda t: (t * 1000).round().to(torch.int64),
}


def never_load_a_model(monkeypatch):
    """Make loading a model fail loudly: a check that runs before it cannot reach it."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the checkpoint was checked")

    monkeypatch.setattr(imagerl.train, "load_adapter", loaded)
    monkeypatch.setattr(imagerl.sft.trainer, "load_sft_adapter", loaded)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("imagerl: error: "), err[-3000:]
    return lines[0]


def resume(run_dir, ckpt="latest", *overrides):
    return main(["train", "--resume", str(ckpt), "--output-dir", str(run_dir), "train.num_rollouts=3", *overrides])


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("part", ["model/", "/exp_avg_sq"])  # the LoRA, AdamW's second moment
@pytest.mark.parametrize("bad", list(BAD_TENSORS))
def test_resume_refuses_a_tensor_type_the_model_does_not_use_before_the_model_loads(run, tmp_path, monkeypatch,
                                                                                    capsys, part, bad):
    run_dir = copy_run(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    key = replace_tensor(ckpt / "trainer" / "tensors.safetensors", part, BAD_TENSORS[bad])
    _rewrite_checksums(ckpt)  # a consistent checkpoint: only the type gives it away
    never_load_a_model(monkeypatch)
    assert resume(run_dir) == 2
    line = one_error_line(capsys)
    assert "tensors.safetensors" in line and key in line and "resume from an earlier checkpoint" in line


@pytest.mark.parametrize("make", [first_nan, first_inf], ids=["nan", "inf"])
def test_resume_refuses_a_non_finite_tensor_in_one_line(run, tmp_path, capsys, make):
    run_dir = copy_run(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    key = replace_tensor(ckpt / "trainer" / "tensors.safetensors", "model/", make)
    _rewrite_checksums(ckpt)
    assert resume(run_dir) == 2
    assert f"{key} is not finite" in one_error_line(capsys)


def _edit_json(file, edit):
    value = json.loads(file.read_text())
    edit(value)
    file.write_text(json.dumps(value))


def _set_group(key, value):
    def edit(structure):
        structure["state"]["optim"]["param_groups"][0][key] = value
    return edit


@pytest.mark.parametrize("key, value", [("maximize", True), ("amsgrad", True), ("decoupled_weight_decay", False),
                                        ("nesterov", True)])
def test_resume_refuses_an_optimizer_setting_that_is_not_the_runs(run, tmp_path, tiny_checkpoint, key, value):
    """maximize=true would climb the loss; amsgrad and decoupled weight decay change the step; nesterov is no
    AdamW setting at all. None is a setting of imagerl's: a checkpoint that has them was altered."""
    run_dir = copy_run(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    _edit_json(ckpt / "trainer" / "structure.json", _set_group(key, value))
    _rewrite_checksums(ckpt)
    with pytest.raises(ValueError, match=rf"structure.json.*{key}"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")


def test_resume_runs_with_the_configs_optimizer_settings_whatever_the_checkpoint_says(run, tmp_path,
                                                                                      tiny_checkpoint):
    run_dir = copy_run(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    crafted = {"lr": 123.0, "betas": [0.1, 0.2], "eps": 0.5, "weight_decay": 0.9, "foreach": True}
    for key, value in crafted.items():
        _edit_json(ckpt / "trainer" / "structure.json", _set_group(key, value))
    _rewrite_checksums(ckpt)
    cfg = tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3")
    train(cfg, resume="latest")
    (group,) = read_trainer_state(run_dir / "checkpoints" / "step_000003" / "trainer")["optim"]["param_groups"]
    t = cfg.train
    assert (group["lr"], list(group["betas"]), group["eps"], group["weight_decay"]) == (
        t.lr, [t.adam_beta1, t.adam_beta2], t.adam_eps, t.weight_decay)
    assert group["foreach"] is None and group["maximize"] is False  # the optimizer's own


@pytest.mark.parametrize("step", [-3, True, 2.0, "2", None])
def test_resume_refuses_a_step_that_is_not_a_non_negative_integer(run, tmp_path, capsys, step):
    run_dir = copy_run(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    _edit_json(ckpt / "state.json", lambda state: state.update(step=step))
    assert resume(run_dir, ckpt) == 2
    assert "state.json" in one_error_line(capsys)


@pytest.mark.parametrize("moment, value", [("step", -3.0), ("step", 2.5), ("exp_avg_sq", -1.0)])
def test_resume_refuses_optimizer_state_adam_cannot_have(run, tmp_path, tiny_checkpoint, moment, value):
    """A negative or fractional step count skews Adam's bias correction; a negative second moment has no square
    root."""
    run_dir = copy_run(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    key = replace_tensor(ckpt / "trainer" / "tensors.safetensors", f"/{moment}",
                         lambda t: torch.full_like(t, value))
    _rewrite_checksums(ckpt)
    with pytest.raises(ValueError, match=rf"{key}"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")


def _as_format_1_with_a_pickle(ckpt, marker):
    import pickle

    from test_checkpoint_safety import _Exploit

    (ckpt / "dcp").mkdir()
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    shutil.rmtree(ckpt / "trainer")
    _edit_json(ckpt / "state.json", lambda state: state.pop("format"))
    _rewrite_checksums(ckpt)


def _flip_a_byte(ckpt):
    f = ckpt / "trainer" / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


CHECKPOINT_FAULTS = {
    "format-1": lambda ckpt, tmp: _as_format_1_with_a_pickle(ckpt, tmp / "pwned"),
    "checksum": lambda ckpt, tmp: _flip_a_byte(ckpt),
    "structure": lambda ckpt, tmp: ((ckpt / "trainer" / "structure.json").write_text('{"format": 2, "state": ['),
                                    _rewrite_checksums(ckpt)),
    "unlisted": lambda ckpt, tmp: (ckpt / "trainer" / "extra.json").write_text("{}"),
}


@pytest.mark.parametrize("fault", list(CHECKPOINT_FAULTS))
def test_a_bad_checkpoint_is_refused_before_the_model_loads(run, tmp_path, monkeypatch, capsys, fault):
    run_dir = copy_run(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    CHECKPOINT_FAULTS[fault](ckpt, tmp_path)
    never_load_a_model(monkeypatch)
    assert resume(run_dir, ckpt) == 2
    assert str(ckpt) in one_error_line(capsys)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- sample --lora, eval --lora


def _lora_file(lora):
    return lora / "adapter_model.safetensors"


def _drop_a_tensor(lora):
    tensors = load_file(_lora_file(lora))
    del tensors[sorted(tensors)[0]]
    save_file(tensors, _lora_file(lora))


def _add_a_tensor(lora):
    tensors = load_file(_lora_file(lora))
    tensors["base_model.model.transformer_blocks.0.attn.to_nowhere.lora_A.weight"] = torch.zeros(8, 32)
    save_file(tensors, _lora_file(lora))


def _widen_a_tensor(lora):
    replace_tensor(_lora_file(lora), "lora_A", lambda t: torch.zeros(t.shape[0], t.shape[1] + 1))


def _claim_another_rank(lora):
    _edit_json(lora / "adapter_config.json", lambda config: config.update(r=4))


LORA_FAULTS = {  # name: (change, the file the error names)
    "nan": (lambda lora: replace_tensor(_lora_file(lora), "lora_B", first_nan), "adapter_model.safetensors"),
    "inf": (lambda lora: replace_tensor(_lora_file(lora), "lora_A", first_inf), "adapter_model.safetensors"),
    "complex-nan": (lambda lora: replace_tensor(_lora_file(lora), "lora_A", BAD_TENSORS["complex-nan"]),
                    "adapter_model.safetensors"),
    "int": (lambda lora: replace_tensor(_lora_file(lora), "lora_A", BAD_TENSORS["int"]), "adapter_model.safetensors"),
    "empty": (lambda lora: save_file({}, _lora_file(lora)), "adapter_model.safetensors"),
    "missing-key": (_drop_a_tensor, "adapter_model.safetensors"),
    "unknown-key": (_add_a_tensor, "adapter_model.safetensors"),
    "shape": (_widen_a_tensor, "adapter_model.safetensors"),
    "rank": (_claim_another_rank, "adapter_config.json"),
}


def lora_command(command, model, lora, tmp_path):
    common = ["--model", str(model), "--lora", str(lora), "--steps", "2", "--height", "64", "--width", "64",
              "--device", "cpu"]
    if command == "sample":
        return ["sample", *common, "--prompt", "a red circle", "--out", str(tmp_path / "out" / "s.png")]
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    return ["eval", *common, "--prompts", str(prompts), "--out", str(tmp_path / "out")]


@pytest.mark.parametrize("fault", list(LORA_FAULTS))
@pytest.mark.parametrize("command", ["sample", "eval"])
def test_sample_and_eval_refuse_an_adapter_that_is_not_finite_or_does_not_match_the_model(
        run, tiny_checkpoint, tmp_path, capsys, command, fault):
    lora = tmp_path / "lora"
    shutil.copytree(run / "checkpoints" / "step_000002" / "lora", lora)
    change, named = LORA_FAULTS[fault]
    change(lora)
    assert main(lora_command(command, tiny_checkpoint, lora, tmp_path)) == 2
    assert str(lora / named) in one_error_line(capsys)
    assert not (tmp_path / "out").exists()  # no black PNG, no score of the base model under the LoRA's name


def test_the_intact_adapter_samples_and_evaluates(run, tiny_checkpoint, tmp_path):
    """Control for the cases above: the copy alone breaks nothing."""
    lora = tmp_path / "lora"
    shutil.copytree(run / "checkpoints" / "step_000002" / "lora", lora)
    for command in ("sample", "eval"):
        assert main(lora_command(command, tiny_checkpoint, lora, tmp_path / command)) == 0


# ---------------------------------------------------------------- imagerl sft: resume and export


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("sft_data")
    for name, rgb in {"red": (220, 30, 30), "blue": (30, 30, 220)}.items():
        Image.new("RGB", (64, 64), rgb).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(name + "\n")
    return root


def _sft_run(tiny_checkpoint, data, out, rank):
    from imagerl.sft.trainer import SFTConfig, sft

    return sft(SFTConfig(model=str(tiny_checkpoint), data=str(data), output_dir=str(out), device="cpu", height=64,
                         width=64, batch_size=2, num_steps=2, log_every=1, tensorboard=False,
                         gradient_checkpointing=False, lora_rank=rank, lora_alpha=16)).run_dir


@pytest.fixture(scope="module")
def sft_lora(tiny_checkpoint, sft_data, tmp_path_factory):
    return _sft_run(tiny_checkpoint, sft_data, tmp_path_factory.mktemp("sft") / "lora", 8)


@pytest.fixture(scope="module")
def sft_full(tiny_checkpoint, sft_data, tmp_path_factory):
    return _sft_run(tiny_checkpoint, sft_data, tmp_path_factory.mktemp("sft") / "full", 0)


@pytest.mark.parametrize("bad", ["nan", "complex-nan"])
def test_sft_resume_refuses_a_bad_tensor(sft_lora, tmp_path, monkeypatch, capsys, bad):
    run_dir = tmp_path / "run"
    shutil.copytree(sft_lora, run_dir)
    ckpt = run_dir / "checkpoints" / "step_000002"
    key = replace_tensor(ckpt / "trainer" / "tensors.safetensors", "model/",
                         first_nan if bad == "nan" else BAD_TENSORS[bad])
    _rewrite_checksums(ckpt)
    if bad != "nan":  # a type is seen in the file's header, before the model loads
        never_load_a_model(monkeypatch)
    assert main(["sft", "--output-dir", str(run_dir), "--resume", "latest", "num_steps=3"]) == 2
    assert key in one_error_line(capsys)


@pytest.mark.parametrize("bad", ["nan", "inf", "complex-nan", "int"])
def test_sft_export_refuses_a_lora_that_is_not_finite_floats(sft_lora, tmp_path, capsys, bad):
    run_dir = tmp_path / "run"
    shutil.copytree(sft_lora, run_dir)
    ckpt = run_dir / "checkpoints" / "step_000002"
    make = {"nan": first_nan, "inf": first_inf, **BAD_TENSORS}[bad]
    key = replace_tensor(ckpt / "lora" / "adapter_model.safetensors", "lora_B", make)
    _rewrite_checksums(ckpt)
    assert main(["sft", "--export", str(run_dir), str(tmp_path / "export")]) == 2
    line = one_error_line(capsys)
    assert "adapter_model.safetensors" in line and key in line
    assert not (tmp_path / "export").exists() and not (tmp_path / "export.partial").exists()


@pytest.mark.parametrize("bad", ["nan", "complex-nan"])
def test_sft_export_refuses_a_full_fine_tune_with_bad_weights(sft_full, tmp_path, capsys, bad):
    run_dir = tmp_path / "run"
    shutil.copytree(sft_full, run_dir, symlinks=True)
    ckpt = run_dir / "checkpoints" / "step_000002"
    (weights,) = (ckpt / "model" / "transformer").glob("*.safetensors")
    key = replace_tensor(weights, "transformer_blocks.0", first_nan if bad == "nan" else BAD_TENSORS[bad])
    _rewrite_checksums(ckpt)
    assert main(["sft", "--export", str(run_dir), str(tmp_path / "export")]) == 2
    line = one_error_line(capsys)
    assert weights.name in line and key in line
    assert not (tmp_path / "export").exists()


def test_sft_export_refuses_a_checkpoint_that_does_not_match_its_checksums(sft_lora, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(sft_lora, run_dir)
    ckpt = run_dir / "checkpoints" / "step_000002"
    replace_tensor(ckpt / "lora" / "adapter_model.safetensors", "lora_B", lambda t: t + 1)  # finite, just altered
    assert main(["sft", "--export", str(run_dir), str(tmp_path / "export")]) == 2
    assert "adapter_model.safetensors does not match its checksum" in one_error_line(capsys)
    assert not (tmp_path / "export").exists()
