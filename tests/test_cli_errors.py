"""Files and settings that used to end in a traceback end in one `imagerl: error:` line naming the file or the
setting, with exit code 2 (tiny checkpoint, CPU): safetensors files with a broken header, JSON and YAML nested past
any sense, crafted adapter configs and RNG files, a shape mismatch, a LoRA rank or a learning rate no model can
use, and YAML alias bombs given to `imagerl sft`."""

import json
import shutil
import struct
import time

import pytest
from safetensors.torch import load_file, save_file

from conftest import tiny_config
from imagerl.cli import main
from imagerl.train import train
from test_checkpoint_safety import _rewrite_checksums
from test_hostile_inputs import BOMB
from test_load_validation import lora_command, one_error_line


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    """A 1-rollout run with its checkpoint, copied by each test that changes it."""
    run_dir = tmp_path_factory.mktemp("cli_errors") / "run"
    train(tiny_config(tiny_checkpoint, run_dir, "train.num_rollouts=1", "run.checkpoint_every=1"))
    return run_dir


def copy_run(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_000001"


def resume(run_dir, ckpt):
    return main(["train", "--resume", str(ckpt), "--output-dir", str(run_dir), "train.num_rollouts=2"])


def _header_of(length: int, file):
    data = file.read_bytes()
    return struct.pack("<Q", length) + data[8:]


SAFETENSORS_FAULTS = {  # what the safetensors library raises SafetensorError for
    "header-2^62": lambda f: f.write_bytes(_header_of(2**62, f)),
    "header-past-eof": lambda f: f.write_bytes(_header_of(f.stat().st_size, f)),
    "truncated": lambda f: f.write_bytes(f.read_bytes()[:-7]),
    "non-json-header": lambda f: f.write_bytes(struct.pack("<Q", 9) + b"not json!" + b"\0" * 16),
}

DEEP = "[" * 100_000 + "]" * 100_000  # json and PyYAML recurse: a RecursionError, not a parse error


@pytest.mark.parametrize("fault", list(SAFETENSORS_FAULTS))
@pytest.mark.parametrize("file", ["trainer/tensors.safetensors", "rng/rank_00000.safetensors"])
def test_a_broken_safetensors_header_on_resume(run, tmp_path, capsys, file, fault):
    run_dir, ckpt = copy_run(run, tmp_path)
    SAFETENSORS_FAULTS[fault](ckpt / file)
    _rewrite_checksums(ckpt)
    assert resume(run_dir, ckpt) == 2
    assert str(ckpt / file) in one_error_line(capsys)


@pytest.mark.parametrize("fault", list(SAFETENSORS_FAULTS))
def test_a_broken_safetensors_header_in_a_lora(run, tiny_checkpoint, tmp_path, capsys, fault):
    lora = tmp_path / "lora"
    shutil.copytree(run / "checkpoints" / "step_000001" / "lora", lora)
    SAFETENSORS_FAULTS[fault](lora / "adapter_model.safetensors")
    assert main(lora_command("sample", tiny_checkpoint, lora, tmp_path)) == 2
    assert str(lora / "adapter_model.safetensors") in one_error_line(capsys)


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def _nest_inside(file):
    """A valid file with a 500-deep mapping inside: json reads it, the code that walks it would recurse past
    Python's limit (the config's flattening on resume, the trainer state's unflattening)."""
    data = json.loads(file.read_text())
    (data["config"] if file.name == "state.json" else data["state"])["deep"] = _nested(500)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("depth", ["100000-deep-file", "500-deep-inside"])
@pytest.mark.parametrize("file", ["trainer/structure.json", "state.json"])
def test_deeply_nested_json_in_a_checkpoint(run, tmp_path, capsys, file, depth):
    run_dir, ckpt = copy_run(run, tmp_path)
    if depth == "500-deep-inside":
        _nest_inside(ckpt / file)
    else:
        (ckpt / file).write_text(DEEP)
    if file != "state.json":
        _rewrite_checksums(ckpt)
    assert resume(run_dir, ckpt) == 2
    assert str(ckpt / file) in one_error_line(capsys)


ADAPTER_CONFIGS = {
    "deep": DEEP,
    "no-r": lambda c: c.pop("r"),
    "r-two": lambda c: c.update(r="two"),
    "r-1e12": lambda c: c.update(r=1e12),
    "r-10^12": lambda c: c.update(r=10**12),
    "r-true": lambda c: c.update(r=True),
    "alpha-nan": lambda c: c.update(lora_alpha=float("nan")),
    "targets-string": lambda c: c.update(target_modules="to_q"),
    "targets-unknown": lambda c: c.update(target_modules=["to_nowhere"]),
    "dora": lambda c: c.update(use_dora=True),
    "a-list": [1, 2, 3],
}


@pytest.mark.parametrize("command", ["sample", "eval"])
@pytest.mark.parametrize("fault", list(ADAPTER_CONFIGS))
def test_a_crafted_adapter_config(run, tiny_checkpoint, tmp_path, capsys, fault, command):
    lora = tmp_path / "lora"
    shutil.copytree(run / "checkpoints" / "step_000001" / "lora", lora)
    file = lora / "adapter_config.json"
    change = ADAPTER_CONFIGS[fault]
    if callable(change):
        config = json.loads(file.read_text())
        change(config)
        file.write_text(json.dumps(config))
    else:
        file.write_text(change if isinstance(change, str) else json.dumps(change))
    assert main(lora_command(command, tiny_checkpoint, lora, tmp_path)) == 2
    assert str(file) in one_error_line(capsys)


def _rng(ckpt, change_tensors=None, change_metadata=None):
    from safetensors import safe_open

    file = ckpt / "rng" / "rank_00000.safetensors"
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(file)
    if change_tensors:
        change_tensors(tensors)
    if change_metadata:
        change_metadata(metadata)
    save_file(tensors, file, metadata=metadata)


def _python_state(edit):
    def change(metadata):
        state = json.loads(metadata["python"])
        edit(state)
        metadata["python"] = json.dumps(state)
    return change


RNG_FAULTS = {
    "no-torch-state": dict(change_tensors=lambda t: t.pop("torch")),
    "short-torch-state": dict(change_tensors=lambda t: t.update(torch=t["torch"][:100].clone())),
    "float-numpy-keys": dict(change_tensors=lambda t: t.update(numpy_keys=t["numpy_keys"].float())),
    "no-metadata": dict(change_metadata=lambda m: m.clear()),
    "python-not-json": dict(change_metadata=lambda m: m.update(python="[3, [1, 2")),
    "python-deep": dict(change_metadata=lambda m: m.update(python=DEEP)),
    "python-short-state": dict(change_metadata=_python_state(lambda s: s.__setitem__(1, s[1][:10]))),
    "python-words-as-strings": dict(change_metadata=_python_state(lambda s: s.__setitem__(1, ["x"] * 625))),
    "numpy-a-dict": dict(change_metadata=lambda m: m.update(numpy='{"kind": "MT19937"}')),
}


@pytest.mark.parametrize("fault", list(RNG_FAULTS))
def test_a_crafted_rng_file(run, tmp_path, capsys, fault):
    run_dir, ckpt = copy_run(run, tmp_path)
    _rng(ckpt, **RNG_FAULTS[fault])
    _rewrite_checksums(ckpt)
    assert resume(run_dir, ckpt) == 2
    assert str(ckpt / "rng" / "rank_00000.safetensors") in one_error_line(capsys)


def test_a_deeply_nested_jsonl_prompt_line(tiny_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red circle"}\n{"prompt": "x", "meta": ' + DEEP + "}\n")
    assert main(["eval", "--model", str(tiny_checkpoint), "--prompts", str(prompts), "--device", "cpu",
                 "--out", str(tmp_path / "out")]) == 2
    assert f"{prompts}:2" in one_error_line(capsys)


def test_a_deeply_nested_sft_data_line(tiny_checkpoint, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"image": "a.png", "prompt": "x", "meta": ' + DEEP + "}\n")
    assert main(["sft", "--model", str(tiny_checkpoint), "--data", str(data), "--output-dir", str(tmp_path / "r")]) == 2
    assert f"{data}:1" in one_error_line(capsys)


@pytest.mark.parametrize("command", [["train", "train.lr="], ["sft", "--model", "tiny", "--data", "x.jsonl", "lr="]],
                         ids=["train", "sft"])
def test_a_50000_deep_override(tmp_path, capsys, command):
    deep = "[" * 50_000 + "]" * 50_000
    *args, key = command
    assert main([*args, "--output-dir", str(tmp_path / "r"), key + deep]) == 2
    assert key.rstrip("=") in one_error_line(capsys)


@pytest.mark.parametrize("args, named", [
    (["train", "model.lora_rank=1000000000"], "model.lora_rank"),
    (["train", "train.lr=1e39"], "train.lr"),
    (["train", "train.lr=2.0"], "train.lr"),
    (["train", "train.weight_decay=1e6"], "train.weight_decay"),
    (["train", "train.clip_range=1e39"], "train.clip_range"),
    (["train", "train.adv_clip_max=1e39"], "train.adv_clip_max"),
    (["sft", "--model", "tiny", "--data", "x.jsonl", "lora_rank=1000000000"], "lora_rank"),
    (["sft", "--model", "tiny", "--data", "x.jsonl", "lr=1e39"], "lr"),
], ids=["rank", "lr-1e39", "lr-2", "weight-decay", "clip-range", "adv-clip", "sft-rank", "sft-lr"])
def test_settings_no_model_can_use_are_refused_before_anything_loads(tmp_path, capsys, args, named):
    """model.lora_rank=1e9 failed allocating the LoRA, train.lr=1e39 in AdamW after a whole rollout."""
    assert main([*args[:1], "--output-dir", str(tmp_path / "r"), *args[1:]]) == 2
    line = one_error_line(capsys)
    assert f"{named} must" in line or f"{named}=" in line


def test_a_lora_of_another_shape_is_one_line(run, tiny_checkpoint, tmp_path, capsys):
    from test_load_validation import replace_tensor

    lora = tmp_path / "lora"
    shutil.copytree(run / "checkpoints" / "step_000001" / "lora", lora)
    replace_tensor(lora / "adapter_model.safetensors", "lora_B", lambda t: t[:-1].clone())
    assert main(lora_command("sample", tiny_checkpoint, lora, tmp_path)) == 2
    assert "has shape" in one_error_line(capsys)


def test_a_metrics_record_with_only_a_monitor_key_does_not_stop_a_resume(run, tmp_path, capsys):
    """metrics.jsonl is a log: a first record that lacks some drift-monitor values leaves the monitors to measure
    from the resumed run's first rollout, with a warning naming the file."""
    run_dir, ckpt = copy_run(run, tmp_path)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "monitor/saturation": 0.5}) + "\n")
    with pytest.warns(UserWarning, match=r"metrics.jsonl.*drift monitors"):
        assert resume(run_dir, ckpt) == 0


# ---------------------------------------------------------------- YAML alias bombs through imagerl sft


def test_an_alias_bomb_as_an_sft_override_is_refused_fast(tmp_path, capsys):
    value = "{" + BOMB.replace("\n", ", ").replace("train: {lr: *i}", "z: *i") + "}"
    assert len(value) < 500
    start = time.perf_counter()
    assert main(["sft", "--model", "quickstart", "--output-dir", str(tmp_path / "r"), f"lr={value}"]) == 2
    assert time.perf_counter() - start < 60  # (expanded it ran on past 2.4 GB; the per-test timeout is the bound)
    line = one_error_line(capsys)
    assert "expands to more than" in line and len(line) < 400


def test_an_alias_bomb_in_sft_config_yaml_is_refused_on_resume(tmp_path, capsys):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "sft_config.yaml").write_text(BOMB.replace("train: {lr: *i}", "lr: *i"))
    assert main(["sft", "--output-dir", str(run_dir), "--resume", "latest"]) == 2
    line = one_error_line(capsys)
    assert str(run_dir / "sft_config.yaml") in line and "expands to more than" in line


@pytest.mark.parametrize("text", ["[1, 2]", "lr: " + "[" * 3000 + "]" * 3000], ids=["a-list", "deep"])
def test_an_sft_config_yaml_that_is_no_mapping_is_refused_on_resume(tmp_path, capsys, text):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "sft_config.yaml").write_text(text)
    assert main(["sft", "--output-dir", str(run_dir), "--resume", "latest"]) == 2
    assert str(run_dir / "sft_config.yaml") in one_error_line(capsys)
