"""Turn formats: the token ids an observation adds to a conversation, computed without re-encoding
what the model wrote.

Design decision (token-in/token-out): the training sequence of a multi-turn sample is the prompt's
ids, then for each turn the ids the policy *sampled*, then the ids of the observation that
answered it. Only the observation is ever tokenized, and it is tokenized on its own; the model's
text is decoded solely so that a tool parser or environment can read it. Re-encoding a decoded
conversation would produce different ids whenever a tokenizer merges across a turn boundary or
normalises text — the trained tokens would no longer be the sampled ones (TRL #5224, verl #6501).

For a chat model the observation's ids are the *difference* its chat template makes: render a
probe conversation ``[user, assistant]`` and the same plus the observation messages and the
generation prompt; the observation is everything after the assistant message's content, minus
the end-of-turn token if the model already sampled it. (A template that is not prefix-stable —
appending a message rewrites earlier text — is refused with a clear error: token-in/token-out is
impossible with it.) A plain model (no chat template, e.g. the demo's character tokenizer) gets
each observation message through a text template such as ``"={content}\\n"``.

Tools are described to a chat model by its template's own ``tools=`` support when it has one;
otherwise a Hermes-style system message lists their JSON schemas and the ``<tool_call>`` format.

A vision-language policy (:class:`VisionChatFormat`) renders through its processor's chat template
instead, and an observation may show images (TRL's multimodal tool responses): the template
writes their placeholders into the observation's text, the processor expands them and makes the
images' tensors (``models.vision.VisionInputs``), which travel with the sample so that later turns
and the training forward embed the same pixels. Images are decoded and resized within
``data.min_pixels`` / ``data.max_pixels`` as prompt images are; one that cannot be used is a
ValueError naming the message and part (the episode counts it as an environment failure). The
text formats refuse image observations the same way (a text-only model cannot see them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from groupflow.data.images import ImageLimits, ImageProblem, load_image
from groupflow.models.vision import (
    VisionInputs,
    encode_text_with_images,
    template_messages,
)

__all__ = [
    "TurnFormat",
    "ChatFormat",
    "PlainFormat",
    "VisionChatFormat",
    "TemplateError",
    "tools_system_prompt",
]

_PROBE_USER = "groupflow probe question"
_PROBE_ASSISTANT = "groupflow probe answer 7f3a"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used turn by turn (named in the message)."""


class TurnFormat(Protocol):
    def prompt_text(self, prompt: str | Sequence[Mapping[str, Any]],
                    first_observation: list[dict] | None = None) -> str: ...  # fmt: skip

    def observation_ids(self, messages: list[dict], last_token: int | None) -> list[int]: ...


def tools_system_prompt(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes function-calling system prompt (for templates without ``tools=`` support)."""
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        "You are a function calling AI model. You may call one or more functions to assist with "
        "the user query. Here are the available tools:\n<tools>\n"
        f"{listing}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _as_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


class ChatFormat:
    """Observations rendered by the tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer, tool_schemas: Sequence[Mapping[str, Any]] = ()):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise TemplateError(
                "the tokenizer has no chat template; use a plain format "
                "(rollout.multi_turn.observation_template) for models without one"
            )
        self.tokenizer = tokenizer
        self.schemas = [dict(s) for s in tool_schemas]
        self.native_tools = bool(self.schemas) and "tools" in str(template)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {}
        if self.schemas and self.native_tools:
            kwargs["tools"] = self.schemas
        elif self.schemas:
            messages = _with_system(messages, tools_system_prompt(self.schemas))
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def prompt_text(self, prompt, first_observation=None) -> str:
        messages = _as_messages(prompt) + list(first_observation or [])
        return self.render(messages, add_generation_prompt=True)

    def observation_ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        text = self.observation_text(_text_only(messages), last_token)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def observation_text(self, messages: list[dict], last_token: int | None) -> str:
        """The text that follows the model's last sampled token up to the next assistant turn."""
        base = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]
        roles = sorted({m["role"] for m in messages})
        try:
            before = self.render(base, add_generation_prompt=False)
            after = self.render(base + list(messages), add_generation_prompt=True)
        except Exception as exc:  # jinja raises its own errors (e.g. "roles must alternate")
            raise TemplateError(
                f"the chat template cannot render observation message(s) with role(s) {roles} "
                f"after an assistant turn ({type(exc).__name__}: {exc}); use an environment "
                "whose observations use a role the template accepts (e.g. 'user')"
            ) from exc
        if not after.startswith(before):
            raise TemplateError(
                "the chat template rewrites earlier turns when a message is appended, so the "
                "token ids of a conversation cannot be built turn by turn (token-in/token-out); "
                f"it renders the assistant turn as {before[-80:]!r} but then as "
                f"{after[len(before) - 80 : len(before)]!r}"
            )
        end = before.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT)
        tail = before[end:]  # the template's end of the assistant turn, e.g. "<|im_end|>\n"
        if last_token is not None:
            sampled = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if sampled and tail.startswith(sampled):
                tail = tail[len(sampled) :]  # the model already wrote the end-of-turn token
        return tail + after[len(before) :]


def _text_only(messages: list[dict]) -> list[dict]:
    """Messages with string contents (text parts joined); image parts are a ValueError: a
    text-only policy cannot see them."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            if any(p.get("type") != "text" for p in content):
                raise ValueError(
                    f"observation message {i} shows an image, but the policy is a text-only "
                    "model (use a vision-language model, or answer with text)"
                )
            m = {**m, "content": "".join(p["text"] for p in content)}
        out.append(m)
    return out


class VisionChatFormat:
    """A vision-language policy's turns, rendered by its processor's chat template; prompts and
    observations may show images (see the module docstring). ``placeholder_ids``: the token ids
    the processor expands images into — a model turn must never contain them (the episode ends
    there), so that every placeholder in a sequence stands for an image that was shown."""

    def __init__(self, processor, tool_schemas: Sequence[Mapping[str, Any]] = (),
                 limits: ImageLimits | None = None):  # fmt: skip
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.chat = ChatFormat(processor, tool_schemas)  # its template, through the processor
        self.limits = limits or ImageLimits()  # data.min_pixels / max_pixels
        tokens = [getattr(processor, k, None) for k in ("image_token", "video_token")]
        unk = self.tokenizer.unk_token_id
        ids = [self.tokenizer.convert_tokens_to_ids(str(t)) for t in tokens if t is not None]
        self.placeholder_ids = sorted({i for i in ids if i is not None and i != unk})

    def prompt_text(self, prompt, first_observation=None) -> str:
        plain, _ = template_messages(_as_messages(prompt) + list(first_observation or []))
        return self.chat.render(plain, add_generation_prompt=True)

    def prompt_inputs(self, prompt, first_observation=None
                      ) -> tuple[str, list[int], VisionInputs | None]:  # fmt: skip
        """(text, ids with placeholders expanded, the images' tensors or None) of a prompt
        followed by an environment's first observation."""
        messages = _as_messages(prompt) + list(first_observation or [])
        plain, _ = template_messages(messages)
        text = self.chat.render(plain, add_generation_prompt=True)
        return text, *self._encode(text, messages)

    def observation_ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        ids, vision = self.observation_inputs(messages, last_token)
        if vision is not None:
            raise ValueError("an observation with images needs observation_inputs (its pixels)")
        return ids

    def observation_inputs(self, messages: list[dict], last_token: int | None
                           ) -> tuple[list[int], VisionInputs | None]:  # fmt: skip
        """The observation's ids (placeholders expanded) and its images' tensors (or None)."""
        plain, _ = template_messages(messages)
        return self._encode(self.chat.observation_text(plain, last_token), messages)

    def _encode(self, text: str, messages: list[dict]) -> tuple[list[int], VisionInputs | None]:
        images = []
        for i, m in enumerate(messages):
            content = m.get("content")
            parts = content if isinstance(content, list) else []
            who = m.get("role", "?") + (f" {m['name']!r}" if m.get("name") else "")
            for k, p in enumerate(parts):
                if p.get("type") != "image":
                    continue
                try:
                    images.append(load_image(p.get("image"), f"message {i} ({who}) content[{k}]",
                                             limits=self.limits))  # fmt: skip
                except ImageProblem as exc:
                    raise ValueError(f"{exc.field}: {exc.reason}") from None
        ids, vision = encode_text_with_images(self.processor, text, images)
        return ids, vision if vision.tensors else None


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content', '')}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class PlainFormat:
    """Models without a chat template: prompts are plain text and each observation message is
    rendered through ``template`` (fields ``content``, ``role``, ``name``)."""

    def __init__(self, tokenizer, template: str = "{content}"):
        try:
            template.format(content="", role="", name="")
        except (KeyError, IndexError, ValueError) as exc:
            raise TemplateError(
                f"observation template {template!r} is not valid: use the fields {{content}}, "
                f"{{role}} and {{name}} ({type(exc).__name__}: {exc})"
            ) from exc
        self.tokenizer = tokenizer
        self.template = template

    def prompt_text(self, prompt, first_observation=None) -> str:
        if not isinstance(prompt, str):
            raise TemplateError(
                "a chat-message prompt needs a tokenizer with a chat template; this format is "
                "for plain-text prompts"
            )
        return prompt + self._render(first_observation or [])

    def observation_ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        return self.tokenizer(self._render(_text_only(messages)), add_special_tokens=False)[
            "input_ids"
        ]

    def _render(self, messages: list[dict]) -> str:
        return "".join(
            self.template.format(
                content=m["content"], role=m.get("role", ""), name=m.get("name", "")
            )
            for m in messages
        )
