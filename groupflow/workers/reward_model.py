"""The reward-model role: a sequence-classification model scoring prompt + response.

Design decision: the reward model is one more worker group the driver calls, and on the driver it
is wrapped as one more reward *component* (``ModelRewardRunner``), so validation, the warm-start
probe and the training step all see a single reward object with ``total``, ``components`` and
``metrics``, and rule-based rewards combine with it by weights. The worker scores *text*: it
re-tokenizes the prompt and response with its own tokenizer — applying its own chat template to
chat prompts when it has one — because a reward model is often trained with a tokenizer or
template different from the policy's, and the policy's token ids would then mean nothing to it.
A missing or malformed model path is reported when the run starts (``check_reward_model_path``),
never at the first scoring call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from groupflow.batch import Batch
from groupflow.config import RewardModelConfig
from groupflow.distributed import PAD_KEY, register
from groupflow.distributed.parallel import init_process_group
from groupflow.models.causal_lm import ModelLoadError, hf_model, resolve_dtype, token_positions
from groupflow.rewards.base import RewardResult
from groupflow.rewards.combine import combine_rewards
from groupflow.workers.common import worker_device

__all__ = ["RewardModelWorker", "ModelRewardRunner", "check_reward_model_path", "reward_texts"]


def check_reward_model_path(cfg: RewardModelConfig) -> None:
    """Fail fast, naming the key, if the reward model or its tokenizer is not a local HF directory."""
    for key, value in (
        ("reward_model.path", cfg.path),
        ("reward_model.tokenizer_path", cfg.tokenizer_path),
    ):
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ModelLoadError(f"{key}: '{path}' does not exist or is not a directory")
        if key == "reward_model.path" and not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{key}: '{path}' has no config.json (not a Hugging Face model directory)"
            )


def reward_texts(
    tokenizer, prompts: Sequence[Any], completions: Sequence[str], use_chat_template: bool | None
) -> list[str]:
    """prompt + response as the reward model reads it.

    Chat prompts (lists of messages) get the response as an assistant turn through the reward
    model's own chat template (when it has one and ``use_chat_template`` is not False); plain
    strings are concatenated with the response unless ``use_chat_template`` is True.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for prompt, completion in zip(prompts, completions):
        chat = isinstance(prompt, list)
        templated = has_template and (use_chat_template if use_chat_template is not None else chat)
        if use_chat_template and not has_template:
            raise ValueError(
                "reward_model.use_chat_template is true, but the reward model's tokenizer has no chat template"
            )
        if templated:
            messages = list(prompt) if chat else [{"role": "user", "content": prompt}]
            messages.append({"role": "assistant", "content": completion})
            out.append(tokenizer.apply_chat_template(messages, tokenize=False))
        elif chat:
            out.append("\n".join(str(m.get("content", "")) for m in prompt) + "\n" + completion)
        else:
            out.append(prompt + completion)
    return out


class RewardModelWorker:
    """A frozen sequence classifier with one output: the score of each (prompt, response)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        cfg: RewardModelConfig,
        rank: int = 0,
        world_size: int = 1,
    ):
        num_labels = getattr(model.config, "num_labels", 1)
        if num_labels != 1:
            raise ModelLoadError(
                f"reward_model.path: the model has {num_labels} labels; a reward model needs exactly 1"
            )
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.cfg, self.rank, self.world_size = tokenizer, cfg, rank, world_size
        self.device = next(model.parameters()).device
        self.tokenizer.truncation_side = "left"  # keep the response (the end) when too long
        self.tokenizer.padding_side = "right"

    @classmethod
    def create(
        cls, rank: int, world_size: int, *, cfg: RewardModelConfig, pg_timeout_s: float = 600.0
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model_path(cfg)
        init_process_group(rank, world_size, pg_timeout_s)
        tok = AutoTokenizer.from_pretrained(
            str(Path(cfg.tokenizer_path or cfg.path).expanduser()), local_files_only=True,
            trust_remote_code=cfg.trust_remote_code,
        )  # fmt: skip
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            str(Path(cfg.path).expanduser()), dtype=resolve_dtype(cfg.dtype), local_files_only=True,
            trust_remote_code=cfg.trust_remote_code,
        )  # fmt: skip
        return cls(model.to(worker_device(rank)), tok, cfg, rank, world_size)

    @register("dp")
    @torch.no_grad()
    def score(self, batch: Batch) -> Batch:
        """``scores`` [B] float32 for non-tensor ``prompt`` (text or messages) and ``completion``."""
        texts = reward_texts(
            self.tokenizer,
            list(batch["prompt"]),
            list(batch["completion"]),
            self.cfg.use_chat_template,
        )
        scores = torch.zeros(len(texts), dtype=torch.float32)
        if PAD_KEY in batch:  # dispatch padding: not worth a forward
            keep = (~batch[PAD_KEY]).nonzero().flatten().tolist()
        else:
            keep = list(range(len(texts)))
        step = self.cfg.micro_batch_samples
        for start in range(0, len(keep), step):
            idx = keep[start : start + step]
            enc = self.tokenizer(
                [texts[i] for i in idx], return_tensors="pt", padding=True, truncation=True,
                max_length=self.cfg.max_length, add_special_tokens=True,
            ).to(self.device)  # fmt: skip
            scores[idx] = self._forward(enc["input_ids"], enc["attention_mask"]).float().cpu()
        return Batch({"scores": scores})

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Score at each row's last real token (not HF's pad-id search, which breaks when pad == EOS)."""
        model = self.model
        head = getattr(model, "score", None)
        if head is None:  # an architecture with its own pooling (e.g. BERT-style [CLS] heads)
            return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
        base = getattr(model, hf_model(model).base_model_prefix)
        out = base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=token_positions(attention_mask),
            use_cache=False,
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        last = attention_mask.long().sum(1) - 1
        return head(hidden[torch.arange(len(last), device=hidden.device), last])[:, 0]


class ModelRewardRunner:
    """Rule-based rewards (a RewardRunner, or none) plus a reward model, combined by weights.

    Behaves like a RewardRunner (``__call__`` -> RewardResult, ``check_fields``), so the trainer,
    validation and the warm-start probe use it unchanged. ``raw_prompts`` maps the rendered
    prompt text (what the policy saw) back to the dataset prompt (text or chat messages), which
    the reward model renders with its own template.
    """

    def __init__(self, rules, scorer, *, weight: float, label: str, raw_prompts: Mapping[str, Any],
                 normalize: str = "none", normalize_eps: float = 1e-6):  # fmt: skip
        self.rules, self.scorer, self.weight, self.label = rules, scorer, weight, label
        self.raw_prompts = dict(raw_prompts)
        self.normalize, self.normalize_eps = normalize, normalize_eps

    def check_fields(self, available) -> None:
        if self.rules is not None:
            self.rules.check_fields(available)

    def missing_fields(self, row) -> list[tuple[str, str]]:
        return [] if self.rules is None else self.rules.missing_fields(row)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], *, group_ids=None, **fields
    ) -> RewardResult:
        raw = [self.raw_prompts.get(p, p) for p in prompts]
        batch = Batch(non_tensors={"prompt": raw, "completion": list(completions)})
        scores = self.scorer.score(batch)["scores"].float()
        metrics = {
            f"reward/{self.label}/mean": float(scores.mean()),
            f"reward/{self.label}/std": float(scores.std(unbiased=False)),
        }
        components, weights, failure = {self.label: scores}, {self.label: self.weight}, 0.0
        if self.rules is not None:
            ruled = self.rules(prompts, completions, **fields)
            components = {**ruled.components, **components}
            weights = {**ruled.weights, **weights}
            metrics = {**ruled.metrics, **metrics}
            failure = self.rules.failure_value
        # one combination of all components, the model's included (reward.normalize applies to it)
        combined = combine_rewards(
            components, weights, failure, group_ids=group_ids, normalize=self.normalize,
            eps=self.normalize_eps,
        )  # fmt: skip
        total = combined.total
        metrics.update({f"reward/{k}/share": v for k, v in combined.shares.items()})
        metrics["reward/total/mean"] = float(total.mean())
        metrics["reward/total/std"] = float(total.std(unbiased=False))
        return RewardResult(total, components, metrics, weights)
