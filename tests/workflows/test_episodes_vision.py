"""Multi-turn episodes whose observations show images (issue 23 item 3) on tiny random Idefics3
and Qwen2-VL: the observation's placeholders are expanded and masked out of the loss, each
later turn decodes with every image so far, the training forward's log-probs equal the sampling
log-probs per sample, and a bad image is a counted failure naming the environment and turn."""

from __future__ import annotations

import importlib

import pytest
import torch
from PIL import Image

from groupflow.agents.environments import ToolEnvironment, normalize_observation
from groupflow.agents.formats import ChatFormat, VisionChatFormat
from groupflow.agents.parsers import build_parser
from groupflow.agents.tools import make_tool
from groupflow.data import PromptRow
from groupflow.data.images import ImageLimits
from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.logprobs import response_logprobs
from groupflow.models.tiny_vlm import tiny_idefics3, tiny_qwen2_vl
from groupflow.models.vision import encode_image_prompt
from groupflow.rollout.engines.base import HFEngine
from groupflow.rollout.engines.batching import generate_batch
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.workflows.episodes import EpisodeLimits, episodes_batch, run_episodes

LIMITS = ImageLimits(min_pixels=28 * 28, max_pixels=56 * 56)


def _build(arch: str):
    tok = train_char_tokenizer()
    model, proc = tiny_idefics3(tok) if arch == "idefics3" else tiny_qwen2_vl(tok)
    # a random model rarely ends a turn; an EOS bias (sampling and training alike) gives turns
    # of a few tokens
    bias = torch.zeros(model.get_output_embeddings().out_features)
    bias[tok.eos_token_id] = 4.0
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: out + bias)
    return model.eval(), proc, tok


@pytest.fixture(scope="module", params=["idefics3", "qwen2_vl"])
def vlm(request):
    return (request.param, *_build(request.param))


@pytest.fixture
def helpers(helpers_on_path):
    return importlib.import_module("agent_helpers")


def _picture(colour) -> Image.Image:
    img = Image.new("RGB", (40, 30), (255, 255, 255))
    img.paste(Image.new("RGB", (12, 12), colour), (4, 6))
    return img


def _run(model, proc, tok, env_factory, prompts, n=2, max_turns=3, max_new=6):
    fmt = VisionChatFormat(proc, limits=LIMITS)
    rows, ids, vision = [], [], []
    for i, p in enumerate(prompts):
        rows.append(PromptRow(p, {}, "mem", i))
        _, pid, vis = encode_image_prompt(proc, p)
        ids.append(pid)
        vision.append(vis if vis.tensors else None)
    engine = HFEngine(model, tok, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)

    def generate(batch, params, width):
        return generate_batch(engine, tok.pad_token_id, batch, params)

    limits = EpisodeLimits(max_turns=max_turns, max_new_tokens=max_new, max_response_tokens=200)
    seeds = list(range(11, 11 + len(rows) * n))
    episodes = run_episodes(
        rows, ids, seeds, list(range(len(rows))), n=n, generate=generate,
        params=SamplingParams(temperature=1.0, max_new_tokens=max_new, n=n), make_env=env_factory,
        fmt=fmt, tokenizer=tok, limits=limits, vision=vision,
    )  # fmt: skip
    return episodes, fmt


def test_observation_images_keep_token_in_token_out_and_logprob_identity(vlm, helpers):
    """Prompts with and without an image; the environment answers every turn with a picture of
    a number: sampled ids are trained as sampled, image placeholders sit only in the prompt and
    the observations (mask 0), and the one-pass training forward over prompt and observation
    images gives the sampling log-probs per sample."""
    arch, model, proc, tok = vlm
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": _picture((255, 0, 0))},
                                      {"type": "text", "text": "add"}]}],
        [{"role": "user", "content": "count"}],
    ]  # fmt: skip
    episodes, fmt = _run(model, proc, tok, helpers.NumberPictureEnv, prompts)
    assert all(e.failure is None for e in episodes), [e.failure for e in episodes]
    with_obs = [e for e in episodes if e.observation_tokens]
    assert len(with_obs) >= 2, [
        (e.finish, len(e.turn_texts)) for e in episodes
    ]  # several episodes saw at least one picture
    place = set(fmt.placeholder_ids)
    assert place == {model.config.image_token_id} | (
        {model.config.video_token_id} if arch != "idefics3" else set()
    )
    for e in episodes:
        sampled = [t for t, m in zip(e.ids, e.mask) if m]
        assert not place & set(sampled)  # placeholders are never actions
        shown = sum(t in place for t, m in zip(e.ids, e.mask) if not m)
        pictures = sum(1 for m in e.messages if isinstance(m["content"], list))
        assert (shown > 0) == (pictures > 0)
        expected = (e.row.index == 0) + pictures
        assert (e.vision.num_images if e.vision else 0) == expected
    batch = episodes_batch(episodes, tok.pad_token_id, 200)
    assert [v.num_images if v else 0 for v in batch["vision"]] == [
        e.vision.num_images if e.vision else 0 for e in episodes
    ]
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                  batch["responses"], batch["response_mask"],
                                  vision=list(batch["vision"]))  # fmt: skip
    mask = batch["response_mask"].bool()
    assert mask.sum() > 10
    torch.testing.assert_close(lp[mask], batch["rollout_logprobs"][mask], atol=3e-5, rtol=0)
    # the observation's pixels matter: a different picture changes the next turn's log-probs
    e = with_obs[0]
    k = next(i for i, v in enumerate(e.images) if v is not None and i == len(e.images) - 1)
    other = dict(e.images[k].tensors)
    other["pixel_values"] = other["pixel_values"].flip(-1) + 0.5
    from groupflow.models.vision import VisionInputs, join_vision

    swapped = join_vision(e.images[:k] + [VisionInputs(other, e.images[k].num_images)])
    i = episodes.index(e)
    with torch.no_grad():
        lp2, _ = response_logprobs(model, batch["prompt_ids"][i : i + 1],
                                   batch["prompt_mask"][i : i + 1], batch["responses"][i : i + 1],
                                   batch["response_mask"][i : i + 1], vision=[swapped])  # fmt: skip
    last = mask[i].nonzero()[-1].item()
    assert abs(lp2[0, last] - lp[i, last]) > 1e-5


def test_a_tool_may_answer_with_an_image(vlm):
    arch, model, proc, tok = vlm

    def show(n: int):
        """Draw a number.

        Args:
            n: the number.
        """
        return [{"type": "text", "text": "here"}, {"type": "image", "image": _picture((0, 0, n))}]

    env = ToolEnvironment([make_tool(show)], build_parser("hermes"))
    text = '<tool_call>{"name": "show", "arguments": {"n": 9}}</tool_call>'
    import asyncio

    obs, reward, done = asyncio.run(env.step(text))
    assert not done and obs[0]["role"] == "tool" and obs[0]["content"][1]["type"] == "image"
    fmt = VisionChatFormat(proc, limits=LIMITS)
    ids, vision = fmt.observation_inputs(normalize_observation(obs), tok.eos_token_id)
    assert vision.num_images == 1 and model.config.image_token_id in ids
    assert tok.decode(ids).startswith("<tool>here")


def test_bad_observation_images_are_counted_failures_naming_env_and_turn(vlm, helpers):
    arch, model, proc, tok = vlm
    prompts = [[{"role": "user", "content": "count"}]]
    episodes, _ = _run(model, proc, tok, helpers.BrokenPictureEnv, prompts, n=2, max_turns=3)
    failed = [e for e in episodes if e.failure is not None]
    assert failed and all(e.finish == "env_failure" and e.failure_kind == "invalid" for e in failed)
    assert "BrokenPictureEnv: turn 1: message 0 (user) content[0]" in failed[0].failure
    assert "image file not found" in failed[0].failure


def test_text_only_formats_refuse_image_observations():
    tok = train_char_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    obs = normalize_observation({"role": "user", "content": [{"type": "image", "image": "x.png"}]})
    with pytest.raises(ValueError, match="text-only model"):
        ChatFormat(tok).observation_ids(obs, None)
    with pytest.raises(ValueError, match="a list of text and image parts"):
        normalize_observation({"role": "user", "content": [{"type": "image"}]})


def test_a_first_observation_with_an_image_extends_the_prompt(vlm, helpers):
    arch, model, proc, tok = vlm
    prompts = [[{"role": "user", "content": "what is shown?"}]]
    episodes, _ = _run(model, proc, tok, helpers.PictureFirstEnv, prompts, n=2, max_turns=1)
    assert all(e.failure is None for e in episodes)
    for e in episodes:
        assert e.vision.num_images == 1 and model.config.image_token_id in e.prompt_ids
    batch = episodes_batch(episodes, tok.pad_token_id, 200)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                  batch["responses"], batch["response_mask"],
                                  vision=list(batch["vision"]))  # fmt: skip
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(lp[mask], batch["rollout_logprobs"][mask], atol=3e-5, rtol=0)


def test_a_sampled_placeholder_token_ends_the_episode_before_it(vlm, helpers):
    """A turn that samples an image placeholder is cut before it and counted as a failure, so no
    later context holds a placeholder without its image."""
    from groupflow.batch import Batch

    arch, model, proc, tok = vlm
    place = model.config.image_token_id
    a, b = tok.convert_tokens_to_ids(["a", "b"])

    def generate(batch, params, width):
        k = len(batch["prompt_token_ids"]) * params.n
        return Batch({"responses": torch.tensor([[a, place, b]] * k),
                      "response_mask": torch.ones(k, 3, dtype=torch.long),
                      "rollout_logprobs": torch.full((k, 3), -1.0)},
                     {"finish_reason": ["stop"] * k})  # fmt: skip

    fmt = VisionChatFormat(proc, limits=LIMITS)
    row = PromptRow([{"role": "user", "content": "hi"}], {}, "mem", 3)
    episodes = run_episodes(
        [row], [tok("<user>hi<assistant>")["input_ids"]], [1, 2], [0], n=2, generate=generate,
        params=SamplingParams(max_new_tokens=3, n=2), make_env=helpers.NumberPictureEnv, fmt=fmt,
        tokenizer=tok, limits=EpisodeLimits(max_turns=3, max_new_tokens=3, max_response_tokens=50),
    )  # fmt: skip
    for e in episodes:
        assert e.ids == [a] and e.mask == [1] and e.logprobs == [-1.0]
        assert e.finish == "env_failure" and e.failure_kind == "invalid"
        assert f"turn 1: the model sampled an image placeholder token (id {place})" in e.failure
