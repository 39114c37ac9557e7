"""SDE window validation / choice, the group-complete prompt sampler and prompt-file loading."""

from __future__ import annotations

import json
import re

import pytest
import torch

from imagerl.data.prompts import GroupSampler, PromptSet, load_prompt_set
from imagerl.sampling import SDEWindow, sde_window
from imagerl.sampling.window import validate_window

# ---------------------------------------------------------------- SDE window


@pytest.mark.parametrize(
    "args,key",
    [
        ((10, 6, (0, 5), "random"), "sample.num_sde_steps"),  # window longer than its range
        ((10, 3, (2, 4), 2), "sample.num_sde_steps"),
        ((10, 2, (0, 10), 0), "sample.sde_window_range"),  # hi > num_steps - 1: last step must stay ODE
        ((10, 2, (0, 12), "random"), "sample.sde_window_range"),
        ((10, 2, (-1, 5), 0), "sample.sde_window_range"),
        ((10, 2, (5, 5), 5), "sample.sde_window_range"),  # empty range
        ((10, 2, (0, 5), 4), "sample.sde_window_start"),  # 4 + 2 > 5
        ((10, 2, (2, 6), 1), "sample.sde_window_start"),  # below lo
        ((10, 0, (0, 5), 3), "sample.num_sde_steps"),
        ((10, -1, (0, 5), 3), "sample.num_sde_steps"),
        ((10, 2, (0, 5), "3"), "sample.sde_window_start"),  # not an int
        ((10, 2, (0, 5), 1.0), "sample.sde_window_start"),
        ((10, 2, (0, 5), True), "sample.sde_window_start"),
        ((10, 2, (0, 5), None), "sample.sde_window_start"),
        ((10, 2, (0, 5), "rand"), "sample.sde_window_start"),
    ],
)
def test_validate_window_rejects_with_key_in_message(args, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        validate_window(*args)


@pytest.mark.parametrize(
    "args", [(10, 2, (0, 5), 3), (10, 2, (0, 5), 0), (10, 2, (0, 5), "random"), (10, 9, (0, 9), 0), (10, 1, (8, 9), 8)]
)
def test_validate_window_accepts_valid(args):
    validate_window(*args)


def test_default_flow_grpo_window_is_steps_3_and_4():
    w = sde_window(2, (0, 5), 3, seed=42, rollout_step=17)
    assert w == SDEWindow(3, 2)
    assert list(w.steps) == [3, 4]
    assert [s in w for s in range(10)] == [s in (3, 4) for s in range(10)]


def test_fixed_start_is_returned_for_every_step():
    for step in range(5):
        assert list(sde_window(3, (1, 8), 4, seed=step, rollout_step=step).steps) == [4, 5, 6]


def test_random_start_in_range_deterministic_and_varying():
    lo, hi, size = 1, 8, 3
    starts = []
    for step in range(200):
        w = sde_window(size, (lo, hi), "random", seed=7, rollout_step=step)
        assert lo <= w.start <= hi - size and w.size == size
        torch.manual_seed(step + 1000)  # global RNG state must not matter
        assert sde_window(size, (lo, hi), "random", seed=7, rollout_step=step) == w
        starts.append(w.start)
    assert set(starts) == set(range(lo, hi - size + 1))  # every admissible start occurs
    assert len(set(starts[:10])) > 1  # consecutive steps differ
    other_seed = [sde_window(size, (lo, hi), "random", seed=8, rollout_step=s).start for s in range(200)]
    assert other_seed != starts
    # a one-position range has only one possible start
    assert {sde_window(2, (3, 5), "random", seed=1, rollout_step=s).start for s in range(20)} == {3}


# ---------------------------------------------------------------- GroupSampler


def prompt_set(n):
    prompts = [f"prompt {i}" for i in range(n)]
    return PromptSet(prompts, [{"prompt": p, "i": i} for i, p in enumerate(prompts)])


def test_ranks_split_the_world_list_into_disjoint_halves():
    ps = prompt_set(24)
    single = GroupSampler(ps, prompts_per_rollout=6, seed=3)
    ranks = [GroupSampler(ps, prompts_per_rollout=6, seed=3, rank=r, world_size=2) for r in range(2)]
    for step in range(10):
        full = single.groups_for(step)
        parts = [s.groups_for(step) for s in ranks]
        assert all(len(p.prompts_G) == 3 for p in parts)
        assert parts[0].prompts_G + parts[1].prompts_G == full.prompts_G
        assert not set(parts[0].prompts_G) & set(parts[1].prompts_G)
        assert parts[0].group_ids_G + parts[1].group_ids_G == full.group_ids_G == list(range(6))
        for p in parts:  # metadata travels with its prompt
            assert [m["prompt"] for m in p.metadata_G] == p.prompts_G


def test_steps_walk_an_epoch_permutation_without_repeats():
    ps = prompt_set(12)
    sampler = GroupSampler(ps, prompts_per_rollout=4, seed=0)
    epochs = []
    for epoch in range(3):
        seen = [p for step in range(3 * epoch, 3 * epoch + 3) for p in sampler.groups_for(step).prompts_G]
        assert sorted(seen) == sorted(ps.prompts)  # each prompt exactly once per epoch
        epochs.append(seen)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # reshuffled each epoch
    assert epochs[0] != ps.prompts  # actually shuffled


def test_rollout_straddling_an_epoch_boundary():
    ps = prompt_set(10)
    sampler = GroupSampler(ps, prompts_per_rollout=4, seed=5)
    flat = [p for step in range(5) for p in sampler.groups_for(step).prompts_G]  # 20 slots = 2 epochs
    assert sorted(flat[:10]) == sorted(ps.prompts) and sorted(flat[10:]) == sorted(ps.prompts)


def test_groups_for_is_a_pure_function_of_seed_and_step():
    ps = prompt_set(30)
    a = GroupSampler(ps, prompts_per_rollout=4, seed=11)
    first = a.groups_for(9)
    for step in (0, 3, 20, 9, 1):  # other calls in between
        a.groups_for(step)
    torch.manual_seed(123)
    assert a.groups_for(9) == first
    assert GroupSampler(ps, prompts_per_rollout=4, seed=11).groups_for(9) == first  # fresh object (resume)
    other = [GroupSampler(ps, prompts_per_rollout=4, seed=12).groups_for(s).prompts_G for s in range(7)]
    assert other != [a.groups_for(s).prompts_G for s in range(7)]


@pytest.mark.parametrize("p,w", [(5, 2), (6, 4), (1, 2)])
def test_prompts_per_rollout_not_divisible_by_world_size_raises(p, w):
    with pytest.raises(ValueError, match="divisible"):
        GroupSampler(prompt_set(10), prompts_per_rollout=p, seed=0, rank=0, world_size=w)


# ---------------------------------------------------------------- load_prompt_set


def test_load_txt_skips_blank_lines_and_strips(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a red cat\n\n   \n  two dogs  \nsign saying \"hi\"\n", encoding="utf-8")
    ps = load_prompt_set(f)
    assert ps.prompts == ["a red cat", "two dogs", 'sign saying "hi"']
    assert ps.metadata == [{}, {}, {}] and len(ps) == 3


def test_load_jsonl_keeps_records_as_metadata(tmp_path):
    f = tmp_path / "p.jsonl"
    records = [{"prompt": "a cat", "tag": 1}, {"prompt": "  a sign ", "text": "OPEN"}]
    f.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n", encoding="utf-8")
    ps = load_prompt_set(str(f))
    assert ps.prompts == ["a cat", "a sign"]
    assert ps.metadata == records


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_set(tmp_path / "nope.txt")
    with pytest.raises(ValueError):
        load_prompt_set(tmp_path)  # a directory is not a prompt file


@pytest.mark.parametrize("name,text", [("e.txt", ""), ("w.txt", "\n  \n\n"), ("e.jsonl", ""), ("w.jsonl", "\n \n")])
def test_empty_file(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match="no prompts"):
        load_prompt_set(f)


def test_bad_json_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=re.escape(f"{f}:3")):
        load_prompt_set(f)


@pytest.mark.parametrize("line", ['{"text": "no prompt"}', '{"prompt": ""}', '{"prompt": 3}', '["prompt"]', '"a"'])
def test_jsonl_line_without_prompt(tmp_path, line):
    f = tmp_path / "np.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{f}:2") + ".*prompt"):
        load_prompt_set(f)


@pytest.mark.parametrize("name", ["p.csv", "p.json", "p.TXT.gz"])
def test_unknown_extension(tmp_path, name):
    f = tmp_path / name
    f.write_text("a prompt\n")
    with pytest.raises(ValueError, match="extension"):
        load_prompt_set(f)
