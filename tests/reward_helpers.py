"""Reward functions referenced by import path (``reward_helpers:<name>``) in trainer and CLI tests.

Design decision: each helper is the built-in reverse-task reward plus one controlled deviation
(constant rewards for some groups, a failure on one known sample, a pause at a known point), so a
test can predict exactly what the trainer must do with it. Not collected by pytest (no ``test_``
prefix); tests make it importable with the ``helpers_on_path`` fixture or ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from groupflow.data.synthetic import answer_match_reward

CONSTANT_REWARD = 0.5
FAILING_SAMPLE = 2
_per_sample_calls = {"next": 0}


def _varying(completion: str) -> float:
    # A deterministic value that differs between (almost all) distinct completions.
    return (sum(map(ord, completion)) % 101) / 100


def constant_when_even(prompts, completions, answer):
    """0.5 for every sample of a prompt whose first digit (= last answer digit) is even, so those
    groups carry no signal; a completion-dependent value otherwise."""
    return [
        CONSTANT_REWARD if int(str(a)[-1]) % 2 == 0 else _varying(c)
        for c, a in zip(completions, answer)
    ]


def fails_on_one_sample(prompts, completions, answer):
    """The reverse reward, except that sample ``FAILING_SAMPLE`` of every batch raises.

    The reward runner first calls with the whole batch (which contains the bad sample, so it
    raises), then retries sample by sample in order; the counter identifies the bad one.
    """
    if len(completions) > FAILING_SAMPLE:
        _per_sample_calls["next"] = 0
        raise RuntimeError(f"sample {FAILING_SAMPLE} of this batch is bad")
    index = _per_sample_calls["next"]
    _per_sample_calls["next"] += 1
    if index == FAILING_SAMPLE:
        raise RuntimeError(f"sample {FAILING_SAMPLE} is bad")
    return answer_match_reward(prompts, completions, answer)


def pausing_reverse_reward(prompts, completions, answer, pause_if_exists: str = ""):
    """The reverse reward; blocks while the file ``pause_if_exists`` exists, holding the run at a
    known point so a test can kill it there. An empty path never pauses."""
    while pause_if_exists and Path(pause_if_exists).exists():
        time.sleep(0.05)
    return answer_match_reward(prompts, completions, answer)


def stops_its_process_unless(prompts, completions, answer, parent_pid: int = 0):
    """The reverse reward, except in any process other than ``parent_pid``: there it stops the
    process (SIGSTOP), as a rollout child that stops answering."""
    if os.getpid() != parent_pid:
        os.kill(os.getpid(), signal.SIGSTOP)
    return answer_match_reward(prompts, completions, answer)


async def async_hangs_on_one_sample(prompts, completions, answer):
    """The reverse reward as an async function whose batched call, and the per-sample call of
    sample ``FAILING_SAMPLE``, never return: ``reward.timeout_s`` must cancel them."""
    if len(completions) > 1:
        _per_sample_calls["next"] = 0
        await asyncio.sleep(3600)
    index = _per_sample_calls["next"]
    _per_sample_calls["next"] += 1
    if index == FAILING_SAMPLE:
        await asyncio.sleep(3600)
    return answer_match_reward(prompts, completions, answer)


def last_word_match(prompts, completions, answer, stop=()):
    """1.0 when the last word of the completion, cut at the first of ``stop``, is the answer:
    lm-evaluation-harness's ``exact_match`` after a ``regex`` filter ``(\\w+)\\W*$`` on a
    generation its server cut at the task's ``until`` (tests/serve/test_lm_eval.py)."""
    import re

    out = []
    for c, a in zip(completions, answer):
        cuts = [c.find(s) for s in stop if s in c]
        text = c[: min(cuts)] if cuts else c
        words = re.findall(r"(\w+)\W*$", text)
        out.append(1.0 if words and words[0].strip() == str(a) else 0.0)
    return out
