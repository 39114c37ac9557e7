"""Prompt data: prompt files, the train/test split and the group-complete distributed sampler (prompts), several
prompt sets in one run (mixture), the synthetic shapes world (synthetic)."""

from __future__ import annotations

from imagerl.data.mixture import load_mixture
from imagerl.data.prompts import PromptSet, load_prompt_set, repeat_prompts, resolve_prompt_file, split_prompt_set


def load_train_test(data_cfg) -> tuple[PromptSet, PromptSet | None]:
    """The training prompts and the held-out prompts (None when data.test_prompts is empty).

    data.train_prompts: a named set (NAMED_PROMPT_SETS) or a .txt/.jsonl file. data.test_prompts: "" (no
    evaluation), "split" (hold out data.test_fraction of the train file's distinct prompts, seeded by
    data.split_seed; training then uses the rest), a named set or a .txt/.jsonl file. With data.mixture: its sets'
    prompts, tagged with their set (imagerl.data.mixture.load_mixture)."""
    if data_cfg.mixture:
        return load_mixture(data_cfg)
    train_file = resolve_prompt_file(data_cfg.train_prompts)
    train = load_prompt_set(train_file)
    if not data_cfg.test_prompts:
        return train, None
    if data_cfg.test_prompts == "split":
        train, test = split_prompt_set(train, data_cfg.test_fraction, data_cfg.split_seed)
        if not len(train):
            raise ValueError(f"data.test_prompts=split: {train_file} has a single distinct prompt, nothing is left "
                             "to train on; give more prompts or a separate data.test_prompts file")
        return train, repeat_prompts(test, data_cfg.test_samples_per_prompt)
    test = load_prompt_set(resolve_prompt_file(data_cfg.test_prompts), key="data.test_prompts")
    return train, repeat_prompts(test, data_cfg.test_samples_per_prompt)
