"""Prompt templating and the over-long prompt filter: rows to the exact text the policy sees.

Design decision: the last dataset-level transformation before prompts reach the rollout engine
is kept apart from loading (`groupflow.data.datasets`) because it needs the tokenizer, which
loading does not: `render_prompt` applies the chat template (with the generation prompt) the
same way the engine will, and `filter_overlong` counts tokens on that rendered text, in batches,
so a prompt is dropped (verl's default) or rejected for what the model would actually be fed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from groupflow.data.rows import DataError, Prompt, PromptRow, type_name

__all__ = ["OVERLONG_MODES", "filter_overlong", "prompt_token_lengths", "render_prompt"]

OVERLONG_MODES = ("filter", "error")


def render_prompt(
    row: PromptRow | Prompt, tokenizer: Any, use_chat_template: bool | None = None
) -> str:
    """Render a prompt to the exact text the policy will be conditioned on.

    Chat messages go through `tokenizer.apply_chat_template(..., add_generation_prompt=True)`.
    A plain string is used as is, unless `use_chat_template=True`, which wraps it as one user
    message. `use_chat_template=False` with chat messages is an error (there is no faithful way
    to flatten messages without a template).
    """
    prompt = row.prompt if isinstance(row, PromptRow) else row
    name = _row_name(row)
    if isinstance(prompt, str):
        if not use_chat_template:
            return prompt
        messages = [{"role": "user", "content": prompt}]
    else:
        if use_chat_template is False:
            raise ValueError(
                f"{name}: prompt is a list of chat messages but use_chat_template=False; "
                "use a plain string prompt or enable the chat template"
            )
        messages = prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{name}: the tokenizer has no chat template, so chat-message prompts cannot be "
            "rendered; use plain string prompts or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _row_name(row: Any) -> str:
    if isinstance(row, PromptRow):
        return f"{row.source}, row {row.index}"
    return "prompt"


def prompt_token_lengths(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    add_special_tokens: bool = False,
    batch_size: int = 512,
) -> list[int]:
    """Token counts of rendered prompts, encoded in batches (fast tokenizers encode a batch in
    parallel in Rust, which is what makes filtering a large dataset quick)."""
    lengths: list[int] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start : start + batch_size])
        encoded = tokenizer(
            chunk, add_special_tokens=add_special_tokens, return_attention_mask=False
        )["input_ids"]
        lengths.extend(len(ids) for ids in encoded)
    return lengths


def filter_overlong(
    rows: Iterable[PromptRow],
    tokenizer: Any,
    max_prompt_tokens: int,
    mode: str = "filter",
    *,
    use_chat_template: bool | None = None,
    add_special_tokens: bool = False,
    batch_size: int = 512,
) -> tuple[list[PromptRow], int]:
    """Drop (mode="filter", verl's default) or reject (mode="error") prompts whose templated
    token count exceeds `max_prompt_tokens`. Returns (kept_rows, num_filtered).

    `add_special_tokens` must match how the rollout engine encodes prompts; chat templates
    usually spell out their special tokens in the text, hence the default False.
    """
    if mode not in OVERLONG_MODES:
        raise ValueError(f"overlong prompt mode must be one of {OVERLONG_MODES}, got {mode!r}")
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int):
        raise TypeError(f"max_prompt_tokens must be an int, got {type_name(max_prompt_tokens)}")
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    rows = list(rows)
    texts = [render_prompt(r, tokenizer, use_chat_template) for r in rows]
    lengths = prompt_token_lengths(
        texts, tokenizer, add_special_tokens=add_special_tokens, batch_size=batch_size
    )
    kept = [r for r, n in zip(rows, lengths) if n <= max_prompt_tokens]
    if mode == "error" and len(kept) < len(rows):
        row, n = next((r, n) for r, n in zip(rows, lengths) if n > max_prompt_tokens)
        raise DataError(
            f"prompt has {n} tokens after templating, more than max_prompt_tokens="
            f"{max_prompt_tokens} ({len(rows) - len(kept)} over-long prompts in total); raise "
            "the limit or use mode='filter'",
            source=row.source,
            index=row.index,
            field="prompt",
        )
    return kept, len(rows) - len(kept)
