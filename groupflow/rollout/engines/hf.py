"""Generation with an HF causal LM: shared prompt prefill, per-sample seeded sampling, log-probs.

Design decisions:
- We run our own decode loop instead of ``model.generate``: the sampling filters must be exactly
  the ones in ``groupflow.algorithms`` (so the recorded log-probs and the training forward agree),
  and the G samples of a prompt must share one prefill — the prompt is encoded once and its KV
  cache repeated G times, which is where most of the prompt compute of GRPO goes.
- Every output sample draws its randomness from its own ``torch.Generator`` seeded by the caller,
  one uniform per token (inverse-CDF sampling, so the CPU-side cost does not grow with the
  vocabulary). A sample's tokens therefore depend only on its prompt and seed, not on which other
  prompts share the batch or how much left padding they cause: batched and unbatched generation
  agree, and a resumed run replays the same samples.
- The recorded log-prob is ``log_softmax(logits / T)`` of the sampled token *without* top-k/top-p/
  min-p truncation, which is what the training forward computes (algorithms.md §5).
- In-flight weight updates (``rollout.async_mode: in_flight``) are a callback, ``between``, that
  the loop calls before the prefill and after every sampled token, before the forward that gives
  the next token's logits: it may load a newer version into the model in place and answers the
  version the model holds, which each token records (``token_versions``). The KV cache of the
  tokens before a switch stays as the older weights computed it (as PipelineRL and SkyRL keep
  it): re-encoding it would cost a prefill per switch, and the recorded log-prob is still exactly
  the probability the token was sampled with — the behaviour log-prob the off-policy correction
  needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from groupflow.algorithms import apply_sampling_filters
from groupflow.models.causal_lm import cache_kwarg, output_cache, token_positions
from groupflow.models.vision import collate_vision, vision_positions
from groupflow.rollout.engines.static_cache import StaticDecoder

__all__ = ["SamplingParams", "GenerationOutput", "generate", "left_pad"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    n: int = 1  # samples per prompt, sharing one prefill
    # Decode plumbing, not sampling: a preallocated KV cache for Llama-family models
    # (groupflow.rollout.engines.static_cache); same tokens and log-probs, less copying. Other models,
    # and False, use the HF forward with its dynamic cache.
    static_kv_cache: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class GenerationOutput:
    prompt_ids: torch.Tensor  # [B, P] left-padded, B = prompts * n (sample j of prompt i at i*n+j)
    prompt_mask: torch.Tensor  # [B, P]
    responses: torch.Tensor  # [B, T] right-padded with pad_id
    response_mask: torch.Tensor  # [B, T] 1 for generated tokens up to and including EOS/stop
    logprobs: torch.Tensor  # [B, T] sampling log-probs (0 where masked)
    finish_reasons: list[str] = field(default_factory=list)  # "stop" or "length"
    # [B, T] the policy version whose forward gave each token's logits (-1 where masked); only
    # with ``between`` (in-flight weight updates)
    token_versions: torch.Tensor | None = None


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into a left-padded [N, P] tensor and its attention mask."""
    if not sequences:
        raise ValueError("left_pad: no sequences")
    width = max(len(s) for s in sequences)
    if width == 0:
        raise ValueError("left_pad: every sequence is empty")
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s) == 0:
            raise ValueError(
                f"left_pad: sequence {i} is empty (an empty prompt cannot be generated from)"
            )
        ids[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def _sample(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from [B, V] logits; returns (tokens, their sampling log-probs)."""
    logits = logits.float()
    scale = params.temperature if params.temperature > 0 else 1.0
    scaled = logits / scale if scale != 1.0 else logits

    def filters(x: torch.Tensor, temperature: float) -> torch.Tensor:
        return apply_sampling_filters(x, temperature, top_k=params.top_k, top_p=params.top_p,
                                      min_p=params.min_p)  # fmt: skip

    if params.temperature == 0:
        tokens = filters(logits, 0.0).argmax(-1)
        logz = scaled.logsumexp(-1)
    else:
        plain = not params.top_k and params.top_p >= 1.0 and not params.min_p
        # the filters act on temperature-scaled logits: scale once, filter at temperature 1
        filtered = scaled if plain else filters(scaled, 1.0)
        # amax: max(-1) also finds the indices (20x slower on [16, 49k] on our CPU)
        peak = filtered.amax(-1, keepdim=True)
        # unnormalised probabilities; a filtered-out token (-inf) gets exactly 0. exp in place:
        # a second [B, V] temporary cost 4 ms per step in fresh pages from the allocator.
        tokens, total = _inverse_cdf(torch.sub(filtered, peak).exp_(), _uniforms(generators))
        # Unfiltered, the same sum is the normaliser: log-sum-exp without another pass over [B, V].
        logz = peak.squeeze(-1) + total.log().float() if plain else scaled.logsumexp(-1)
    # logit - log-sum-exp, the training forward's formula (models/logprobs.py)
    logp = scaled.gather(-1, tokens[:, None]).squeeze(-1) - logz
    return tokens, logp


def _uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One U[0, 1) draw per row (float64: 53-bit resolution), from each sample's own generator."""
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])


_CDF_BLOCK = 256  # vocabularies above 16 blocks are searched block sums first, then one block


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token per row — the first index whose cumulative probability exceeds ``u`` × the row
    total — and the row totals (float64). ``probs`` [B, V] need not be normalised.

    One uniform per row, not one per vocabulary entry as an exponential race needs: drawing B·V
    numbers from B CPU generators made sampling 128 rows from a 49k vocabulary take 195 ms per
    decode step on our CPU (61 ms now), and on a GPU it was all of the sampling time plus a 25 MB
    host-to-device copy per step (0.8 ms now on an H200). Cumulative sums are in
    float64 over float32 block sums, then within the chosen block — so even a flat 150k-token
    distribution keeps every token's interval to float32 precision while only [B, V/256] and
    [B, 256] values are float64. A token of probability 0 (filtered out, or padding) has an empty
    interval and is never picked.
    """
    rows, vocab = probs.shape
    block = vocab if vocab <= 16 * _CDF_BLOCK else _CDF_BLOCK
    pad = -vocab % block
    # a pad of 0 would still copy [B, V]
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(rows, -1, block)
    sums = blocks.sum(-1).double()  # [B, n_blocks]
    block_cdf = sums.cumsum(-1)
    target = u.to(device=probs.device, dtype=torch.float64)[:, None] * block_cdf[:, -1:]
    b = _first_above(block_cdf, target)
    before = (block_cdf.gather(-1, b) - sums.gather(-1, b)).clamp(min=0)
    chosen = blocks.gather(1, b[:, :, None].expand(-1, 1, block)).squeeze(1)  # [B, block]
    within = chosen.double().cumsum(-1)
    tokens = (b * block + _first_above(within, target - before)).squeeze(-1)
    return tokens, block_cdf[:, -1]


def _first_above(cdf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Index [B, 1] of the first entry of each row of ``cdf`` greater than ``x`` [B, 1]; ``x`` is
    kept in [0, total), so float rounding can never land on an empty entry at either end."""
    x = torch.minimum(x.clamp(min=0), torch.nextafter(cdf[:, -1:], torch.zeros_like(x)))
    return torch.searchsorted(cdf, x.contiguous(), right=True)


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    seeds: Sequence[int],
    pad_id: int,
    eos_ids: Sequence[int],
    tokenizer=None,
    vision: Sequence | None = None,
    lockstep: Callable[[bool, str], bool] | None = None,
    between: Callable[[], int] | None = None,
) -> GenerationOutput:
    """Sample ``params.n`` responses per prompt.

    ``seeds`` has one entry per output sample (len(prompts) * n). ``tokenizer`` is needed only for
    stop strings. ``vision``: one ``models.vision.VisionInputs`` (or None) per prompt, for a
    vision-language model: the prefill embeds the images, positions come from
    ``vision_positions``, and decoding uses the dynamic cache (``groupflow.models.vision``).

    ``lockstep``: for a model sharded across ranks, whose every layer call is a collective —
    ``lockstep(flag, "any" | "all")`` returns the ranks' common decision
    (``distributed.parallel.agree``), so every rank takes the same decode path and as many steps
    as the longest (a rank whose rows have all finished steps on with them masked: its tokens
    are the same as without lockstep).

    ``between``: in-flight weight updates (module docstring); called before the prefill and
    between decode steps, it may load newer weights into ``model`` in place and returns the
    policy version ``model`` holds; the output's ``token_versions`` records it per token. Not
    with ``lockstep`` (every rank would have to switch at the same step).
    """
    if between is not None and lockstep is not None:
        raise ValueError(
            "generate: in-flight weight updates (between) do not combine with lockstep"
        )
    # Inference mode skips autograd's version counters and view tracking on every decode op
    # (~5-10% of generation on CPU). Its tensors cannot be saved for backward, and the training
    # forward indexes with these ids, so they are cloned back to normal tensors outside it.
    with torch.inference_mode():
        out = _generate(model, prompts, params, seeds, pad_id, eos_ids, tokenizer, vision, lockstep,
                        between)  # fmt: skip
    return dataclasses.replace(
        out, **{k: v.clone() for k, v in vars(out).items() if isinstance(v, torch.Tensor)}
    )


def _generate(model, prompts, params, seeds, pad_id, eos_ids, tokenizer,
              vision=None, lockstep=None, between=None) -> GenerationOutput:  # fmt: skip
    n_out = len(prompts) * params.n
    if len(seeds) != n_out:
        raise ValueError(f"generate: need one seed per output sample ({n_out}), got {len(seeds)}")
    if params.stop and tokenizer is None:
        raise ValueError("generate: stop strings need a tokenizer")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    cache_name = cache_kwarg(model)

    was_training = model.training
    model.eval()
    images: dict[str, torch.Tensor] = {}
    if vision is not None:
        if len(vision) != len(prompts):
            raise ValueError(
                f"generate: need one vision entry per prompt ({len(prompts)}), got {len(vision)}"
            )
        images = collate_vision(vision, device)
    version = between() if between is not None else -1  # what the prefill computes with
    versions_out: list[int] = []
    try:
        # Prefill once per prompt, then share the cache across its n samples.
        if images:
            positions, next_pos = vision_positions(model, prompt_ids, prompt_mask, images)
        else:
            positions, next_pos = token_positions(prompt_mask), prompt_mask.sum(-1)
        out = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **images,
        )
        cache = output_cache(out)
        if cache is None:
            raise RuntimeError(f"{type(model).__name__} returned no KV cache from its prefill")
        logits = out.logits[:, -1]
        decoder = None
        if params.static_kv_cache and not images:  # image prompts: see models/vision.py
            decoder = StaticDecoder.build(
                model, cache, prompt_mask, params.n, params.max_new_tokens
            )
        if lockstep is not None and not lockstep(decoder is not None, "all"):
            decoder = None  # one decode path on every rank (the cache is still intact)
        if params.n > 1:
            if decoder is None:
                cache.batch_repeat_interleave(params.n)
            logits = logits.repeat_interleave(params.n, dim=0)
            prompt_ids = prompt_ids.repeat_interleave(params.n, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(params.n, dim=0)
            next_pos = next_pos.repeat_interleave(params.n, dim=0)
        # next_pos: the position of the first generated token, per row (the row's length for
        # text; after the image grid's positions for multimodal RoPE)
        tokens_out, logps_out = [], []
        alive = torch.ones(n_out, dtype=torch.bool, device=device)
        done_at = torch.full((n_out,), params.max_new_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(n_out, dtype=torch.bool, device=device)
        attn = prompt_mask
        stop_window = _stop_window(params.stop)
        for t in range(params.max_new_tokens):
            tok, logp = _sample(logits, params, generators)
            tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
            tokens_out.append(tok)
            logps_out.append(torch.where(alive, logp, torch.zeros_like(logp)))
            versions_out.append(version)
            finished = alive & torch.isin(tok, eos)
            if params.stop:
                finished |= alive & _hits_stop(tokens_out, params.stop, stop_window, tokenizer)
            done_at = torch.where(finished, torch.full_like(done_at, t + 1), done_at)
            stopped |= finished
            alive &= ~finished
            more = bool(alive.any())
            if lockstep is not None:
                more = lockstep(more, "any")
            if not more or t == params.max_new_tokens - 1:
                break
            if between is not None:  # a newer version computes the next token's logits
                version = between()
            if decoder is not None:
                logits = decoder.step(tok, next_pos + t, t)
                continue
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            out = model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=(next_pos + t)[:, None],
                use_cache=True,
                **{cache_name: cache},
            )
            logits = out.logits[:, -1]
    finally:
        model.train(was_training)

    responses = torch.stack(tokens_out, dim=1)
    width = responses.shape[1]
    response_mask = (torch.arange(width, device=device)[None, :] < done_at[:, None]).long()
    responses = responses.masked_fill(response_mask == 0, pad_id)
    logprobs = torch.stack(logps_out, dim=1) * response_mask
    reasons = ["stop" if s else "length" for s in stopped.tolist()]
    token_versions = None
    if between is not None:
        per_step = torch.tensor(versions_out, dtype=torch.long, device=device)
        token_versions = per_step[None, :].expand(n_out, -1).masked_fill(response_mask == 0, -1)
    return GenerationOutput(prompt_ids, prompt_mask, responses, response_mask, logprobs, reasons,
                            token_versions)  # fmt: skip


def _stop_window(stop: Sequence[str]) -> int:
    # A token decodes to at least one character (special tokens aside), so the last
    # max(len(stop)) tokens always contain a freshly completed stop string.
    return max((len(s) for s in stop), default=0) + 1


def _hits_stop(
    tokens_out: list[torch.Tensor], stop: Sequence[str], window: int, tokenizer
) -> torch.Tensor:
    recent = torch.stack(tokens_out[-window:], dim=1).tolist()
    texts = tokenizer.batch_decode(recent, skip_special_tokens=True)
    return torch.tensor(
        [any(s in text for s in stop) for text in texts], device=tokens_out[-1].device
    )
