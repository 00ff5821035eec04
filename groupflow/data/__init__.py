"""Prompt data: dataset loading and validation, the prompt stream, the synthetic demo task, and
the demo's character tokenizer.

Design decision: everything downstream sees `PromptRow`s (a prompt plus a flat `fields` dict for
reward functions), whatever the file format or row shape; see `rows` for the validation rules,
`datasets` for the readers, `templating` for the rendered prompt and the over-long filter, and
`loader` for the deterministic, resumable prompt stream.
"""

from groupflow.data.datasets import NamedRows, PromptDataset, check_row_fields, load_prompt_rows
from groupflow.data.loader import PromptLoader
from groupflow.data.rows import DataError, PromptRow, normalize_row
from groupflow.data.synthetic import (
    REWARD_FUNCTIONS,
    accuracy,
    add_reward,
    clean_completion,
    exact_match,
    make_task_rows,
    reverse_reward,
    sft_pairs,
)
from groupflow.data.templating import filter_overlong, prompt_token_lengths, render_prompt
from groupflow.data.tokenizer import train_char_tokenizer

__all__ = [
    "DataError",
    "NamedRows",
    "PromptDataset",
    "PromptLoader",
    "PromptRow",
    "REWARD_FUNCTIONS",
    "accuracy",
    "add_reward",
    "check_row_fields",
    "clean_completion",
    "exact_match",
    "filter_overlong",
    "load_prompt_rows",
    "make_task_rows",
    "normalize_row",
    "prompt_token_lengths",
    "render_prompt",
    "reverse_reward",
    "sft_pairs",
    "train_char_tokenizer",
]
