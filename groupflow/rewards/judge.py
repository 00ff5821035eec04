"""LLM-as-judge reward: score each (prompt, response) through any OpenAI-compatible endpoint.

Design decision: the judge is an ordinary ``async`` reward built by a factory from config kwargs,
so the reward runner's time limit, cancellation and failure accounting apply unchanged. One
batched call sends one ``/chat/completions`` request per distinct (prompt, response) -- GRPO
groups often repeat a completion -- at most ``max_concurrency`` at a time over one ``httpx``
client; transient failures (connection errors, timeouts, 429, 5xx) are retried with exponential
backoff (``Retry-After`` honoured). A judgement that still fails, or whose reply holds no score,
is returned as NaN, which the runner counts in ``reward/<name>/failures`` and replaces by the
failure value; the judge logs the reason and the judge's reply text. Successful judgements go to
an optional on-disk cache (SQLite, safe across threads and runs) keyed by a hash of (model, the
rendered messages) -- i.e. of the prompt, the response and the rubric or template -- so re-scoring
a seen pair costs nothing. An API key is sent only when the config names its variable
(``api_key_env``; read from the environment or a ``.env`` file), only in the ``Authorization``
header, only over https or to a loopback host, and never appears in a log line or an error.

A completion that is an image (a [3, H, W] tensor in [0, 1], or a [3, F, H, W] video whose
``frames`` are chosen as by the image rewards) is sent as the response in OpenAI's vision format:
the text part says the response is the attached image, and each chosen frame follows as a PNG
``image_url`` data URL. The cache key hashes those bytes, so a repeated image is judged once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import sqlite3
import string
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import torch

from groupflow.rewards.errors import FailedScore, RewardConfigError
from groupflow.rewards.frames import check_frames, select_frames
from groupflow.utils.env import parse_dotenv, scrub_text

__all__ = ["DEFAULT_SCALE", "DEFAULT_SCORE_REGEX", "make_judge_reward", "parse_score"]

logger = logging.getLogger("groupflow.rewards")

_LOOPBACK = ("127.0.0.1", "localhost", "::1")  # where a key may travel over plain http
# "Score: <number>"; read only after the request's verdict marker (see make_judge_reward).
DEFAULT_SCORE_REGEX = r"[Ss]core\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)"
DEFAULT_SCALE = (0.0, 10.0)  # the default rubric's: a score outside the declared scale is invalid
RUBRIC_SYSTEM = (
    "You are a careful, strict grader. Judge the RESPONSE to the PROMPT by this rubric:\n\n"
    "{rubric}\n\nExplain briefly, then end your reply with one line of the form "
    "'{marker} Score: <number>', the number from {low:g} to {high:g}."
)
# For a template (the user writes the whole request): where the verdict begins.
MARKER_SYSTEM = (
    "Write {marker} immediately before your final verdict: only what follows it is read."
)
_MARKER_FIELD = "marker"  # a template may place the marker itself: "{marker}"
RUBRIC_USER = "PROMPT:\n{prompt}\n\nRESPONSE:\n{response}"
# What {response} reads when the response is an image (the image parts follow the text).
IMAGE_RESPONSE = "(the generated image, attached below)"
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 60.0
_LOGGED_FAILURES_PER_CALL = 3  # the rest of a batch's failures go to the debug log
_REPLY_SHOWN = 400  # characters of a judge reply shown in a log line


class _JudgeFailure(Exception):
    """One judgement that produced no score; ``reply`` is what the judge sent, if anything."""

    def __init__(self, reason: str, reply: str = "") -> None:
        super().__init__(reason)
        self.reason, self.reply = reason, reply


def parse_score(
    reply: str,
    score_regex: str | None = None,
    json_field: str | None = None,
    marker: str | None = None,
    scale: tuple[float, float] | None = None,
) -> float:
    """The score in a judge's reply. Raises ValueError saying why there is none.

    With ``marker`` (what the reward does), only the text after the marker's first occurrence is
    read, and there the FIRST ``score_regex`` match (its first group) or the first JSON object
    holding the (dotted) ``json_field``: the marker is drawn at random for each request, so a
    judged response that the judge quotes, before or after its verdict, cannot supply the score.
    Without one, the LAST match / the reply's JSON object. ``scale``: ``(low, high)``; a score
    outside it is invalid.
    """
    text = reply
    if marker is not None:
        at = reply.find(marker)
        if at == -1:
            raise ValueError(f"the reply has no verdict marker {marker!r}")
        text = reply[at + len(marker) :]
    if json_field is not None:
        value: Any = _first_json_object(text) if marker is not None else _json_object(text)
        for part in json_field.split("."):
            if not isinstance(value, Mapping) or part not in value:
                raise ValueError(f"the reply's JSON has no field {json_field!r}")
            value = value[part]
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"field {json_field!r} is {value!r}, not a number")
        score = float(value)
    else:
        matches = list(re.finditer(score_regex or DEFAULT_SCORE_REGEX, text))
        if not matches:
            raise ValueError(
                "no score found in the reply" + (" after its marker" if marker else "")
            )
        chosen = matches[0] if marker is not None else matches[-1]
        score = float(chosen.group(1) if chosen.groups() else chosen.group(0))
    if not math.isfinite(score):
        raise ValueError(f"score {score} is not finite")
    if scale is not None and not scale[0] <= score <= scale[1]:
        raise ValueError(
            f"score {score:g} is outside the judge's scale [{scale[0]:g}, {scale[1]:g}]"
        )
    return score


def _first_json_object(text: str) -> Any:
    """The first JSON object in ``text`` (fenced or bare)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            return decoder.raw_decode(text, match.start())[0]
        except json.JSONDecodeError:
            continue
    raise ValueError("no JSON object after the marker")


def _json_object(reply: str) -> Any:
    text = reply.strip()
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    candidates = [fenced.group(1)] if fenced else []
    start, end = text.find("{"), text.rfind("}")
    if start != -1 and end > start:
        candidates.append(text[start : end + 1])
    candidates.append(text)
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    raise ValueError("the reply holds no JSON object")


def _api_key(env_name: str | None, base_url: str) -> str | None:
    """The key in the variable the config names (the environment, else ./.env), or None when it
    names none: a key is never picked up implicitly (an ``OPENAI_API_KEY`` set for another tool
    would go to whatever ``base_url`` says), and never sent in clear text off this machine."""
    if env_name is None:
        return None
    if not isinstance(env_name, str) or not env_name:
        raise RewardConfigError(f"judge: api_key_env must be a variable name, got {env_name!r}")
    parsed = urlparse(base_url)
    if parsed.scheme != "https" and (parsed.hostname or "") not in _LOOPBACK:
        raise RewardConfigError(
            f"judge: api_key_env={env_name!r} would send the key over plain http to "
            f"{parsed.hostname!r}; use an https:// base_url (plain http only to 127.0.0.1, "
            "localhost or ::1)"
        )
    if os.environ.get(env_name):
        return os.environ[env_name]
    dotenv = Path(".env")
    if dotenv.is_file():
        value = parse_dotenv(dotenv.read_text(encoding="utf-8"), str(dotenv)).get(env_name)
        if value:
            return value
    raise RewardConfigError(
        f"judge: api_key_env={env_name!r} is not set in the environment or in ./.env"
    )


class _Cache:
    """(key -> score, reply) in a SQLite file; one connection per batched call (its thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS judgements (key TEXT PRIMARY KEY, score REAL, reply TEXT)"
            )

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0)
        try:
            with db:  # commits, or rolls back on an error
                yield db
        finally:
            db.close()

    def get_many(self, keys: Sequence[str]) -> dict[str, float]:
        with self._connect() as db:
            out = {}
            for key in keys:
                row = db.execute("SELECT score FROM judgements WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    out[key] = float(row[0])
            return out

    def put(self, key: str, score: float, reply: str) -> None:
        with self._connect() as db:
            db.execute("INSERT OR REPLACE INTO judgements VALUES (?, ?, ?)", (key, score, reply))


def _template_fields(template: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name}
    except ValueError as e:
        raise RewardConfigError(f"judge: template is not a valid format string: {e}") from None


def _check_positive(name: str, value: Any, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise RewardConfigError(f"judge: {name} must be a positive number, got {value!r}")


def make_judge_reward(
    base_url: str,
    model: str,
    rubric: str | None = None,
    template: str | None = None,
    score_regex: str | None = None,
    json_field: str | None = None,
    max_concurrency: int = 8,
    timeout_s: float = 60.0,
    cache: str | None = None,
    max_retries: int = 3,
    backoff_s: float = 1.0,
    temperature: float = 0.0,
    max_tokens: int | None = 512,
    api_key_env: str | None = None,
    scale: Sequence[float] = DEFAULT_SCALE,
    frames: str | int | Sequence[int] = "first",
) -> Callable[..., Any]:
    """An async reward scoring each completion with a judge model.

    Args:
        base_url: the endpoint's base, e.g. ``https://api.openai.com/v1`` or
            ``http://127.0.0.1:8000/v1``; requests go to ``{base_url}/chat/completions``.
        model: the judge model's name at that endpoint.
        rubric: grading instructions; the judge gets them in a system message and the prompt and
            response in a user message, and is asked to end with ``<marker> Score: <number>``
            on the ``scale``.
        template: instead of ``rubric``, the whole user message as a format string with
            ``{response}`` and optionally ``{prompt}``, ``{marker}`` and any dataset field
            (``{ground_truth}``); without ``{marker}``, a system message asks the judge to write
            it before its verdict.
        score_regex: where the score is in the reply (its first group; the first match after
            the marker counts). Default: ``Score: <number>``.
        json_field: instead, a (dotted) field of the first JSON object after the marker.
        max_concurrency: requests in flight at once.
        timeout_s: per request; a timed-out request is retried like a 5xx.
        cache: an SQLite file for successful judgements (``None``: no cache).
        max_retries, backoff_s: retries of a transient failure, waiting backoff_s * 2^attempt.
        temperature, max_tokens: sampling parameters of the judge.
        api_key_env: the variable holding the API key (e.g. ``OPENAI_API_KEY``; in the
            environment or ./.env, and it must be set). Only then is an ``Authorization`` header
            sent, and only over https or to a loopback host; without it, none.
        scale: ``[low, high]`` of a valid score (default ``[0, 10]``, the default rubric's); a
            reply scoring outside it is an invalid verdict: a failed sample, counted in
            ``reward/<name>/invalid_verdicts`` like a reply with no verdict.
        frames: for video completions, the frames sent ('first', every k-th, or a list).

    The verdict marker (``VERDICT-`` and 6 random hex digits) is drawn for each request; only
    the reply after it is read, so a response that quotes a verdict of its own — which the
    judge may repeat before or after its own — never sets its score.
    """
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise RewardConfigError(f"judge: base_url must be an http(s) URL, got {base_url!r}")
    if not isinstance(model, str) or not model:
        raise RewardConfigError(f"judge: model must be a non-empty string, got {model!r}")
    if (rubric is None) == (template is None):
        raise RewardConfigError("judge: give exactly one of rubric or template")
    if score_regex is not None and json_field is not None:
        raise RewardConfigError("judge: give at most one of score_regex or json_field")
    if score_regex is not None:
        try:
            re.compile(score_regex)
        except re.error as e:
            raise RewardConfigError(f"judge: score_regex {score_regex!r} is invalid: {e}") from None
    fields_used: set[str] = set()
    if template is not None:
        fields_used = _template_fields(template) - {"prompt", "response", _MARKER_FIELD}
        if "response" not in _template_fields(template):
            raise RewardConfigError("judge: template must contain {response}")
    bounds = _scale(scale)
    frames = check_frames(frames)
    _check_positive("max_concurrency", max_concurrency, integer=True)
    _check_positive("timeout_s", timeout_s)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise RewardConfigError(f"judge: max_retries must be an int >= 0, got {max_retries!r}")
    if isinstance(backoff_s, bool) or not isinstance(backoff_s, (int, float)) or backoff_s < 0:
        raise RewardConfigError(f"judge: backoff_s must be >= 0, got {backoff_s!r}")
    api_key = _api_key(api_key_env, base_url)
    store = _Cache(Path(cache)) if cache is not None else None
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    low, high = bounds
    counts = {"invalid_verdicts": 0}
    counts_lock = threading.Lock()

    def messages(prompt: Any, response: Any, row: Mapping[str, Any], marker: str) -> list[dict]:
        prompt = _prompt_text(prompt)
        images = _image_parts(response, frames) if isinstance(response, torch.Tensor) else None
        text = IMAGE_RESPONSE if images is not None else response
        if rubric is not None:
            system = RUBRIC_SYSTEM.format(rubric=rubric, marker=marker, low=low, high=high)
            user = _content(RUBRIC_USER.format(prompt=prompt, response=text), images)
            return [{"role": "system", "content": system}, {"role": "user", "content": user}]
        assert template is not None  # exactly one of rubric and template (checked above)
        user = _content(template.format(prompt=prompt, response=text, marker=marker, **row), images)
        if _MARKER_FIELD in _template_fields(template):
            return [{"role": "user", "content": user}]
        return [
            {"role": "system", "content": MARKER_SYSTEM.format(marker=marker)},
            {"role": "user", "content": user},
        ]

    def key_of(msgs: list[dict[str, str]]) -> str:
        # rendered with a fixed marker: the request's own marker is random
        return hashlib.sha256(
            json.dumps([model, msgs, list(bounds)], sort_keys=True).encode()
        ).hexdigest()

    async def ask(
        client: httpx.AsyncClient, request: tuple[Any, str, Mapping[str, Any]]
    ) -> tuple[float, str]:
        marker = f"VERDICT-{secrets.token_hex(3).upper()}"
        msgs = messages(*request, marker)
        body: dict[str, Any] = {"model": model, "messages": msgs, "temperature": temperature}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        for attempt in range(max_retries + 1):
            wait = backoff_s * 2**attempt
            try:
                resp = await client.post(url, json=body, headers=headers)
            except httpx.TransportError as e:  # connection refused/reset, timeouts
                problem = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code == 200:
                    return _score_of(resp, marker)
                problem = f"HTTP {resp.status_code}"
                if resp.status_code not in _RETRY_STATUS:
                    raise _JudgeFailure(problem, resp.text)
                wait = max(wait, _retry_after(resp))
            if attempt < max_retries:
                await asyncio.sleep(min(wait, _MAX_BACKOFF_S))
        raise _JudgeFailure(f"{problem} after {max_retries + 1} attempts")

    def _score_of(resp: httpx.Response, marker: str) -> tuple[float, str]:
        try:
            reply = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _JudgeFailure("not a chat completion", resp.text) from None
        if not isinstance(reply, str):
            raise _JudgeFailure("the completion has no text content", resp.text)
        try:
            return parse_score(reply, score_regex, json_field, marker, bounds), reply
        except ValueError as e:
            with counts_lock:
                counts["invalid_verdicts"] += 1
            raise _JudgeFailure(f"invalid judgement ({e})", reply) from None

    async def judge(prompts: list[str], completions: list[Any], **fields: list[Any]) -> list[float]:
        missing = sorted(fields_used - set(fields))
        if missing:
            raise RewardConfigError(
                f"judge: template field {{{missing[0]}}} is not a dataset field; available: "
                f"prompt, response, {', '.join(sorted(fields)) or '(none)'}"
            )
        rows = [{k: fields[k][i] for k in fields_used} for i in range(len(completions))]
        requests = list(zip(prompts, completions, rows))
        keys = [key_of(messages(*r, "VERDICT-MARKER")) for r in requests]
        unique = dict(zip(keys, requests))  # GRPO groups repeat completions: judge each once
        known = store.get_many(list(unique)) if store is not None else {}
        todo = [k for k in unique if k not in known]
        results: dict[str, float | _JudgeFailure] = dict(known)
        limit = asyncio.Semaphore(max_concurrency)
        timeout = httpx.Timeout(timeout_s)
        limits = httpx.Limits(max_connections=max_concurrency)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

            async def one(key: str) -> None:
                async with limit:
                    try:
                        score, reply = await ask(client, unique[key])
                    except _JudgeFailure as e:
                        results[key] = e
                        return
                results[key] = score
                if store is not None:
                    store.put(key, score, reply)

            await asyncio.gather(*(one(k) for k in todo))
        if known:
            logger.debug(
                "judge: %d of %d distinct judgements from the cache", len(known), len(unique)
            )
        return _collect(results, keys, completions)

    def take_metrics() -> dict[str, float]:
        with counts_lock:
            taken = {k: float(v) for k, v in counts.items()}
            counts["invalid_verdicts"] = 0
        return taken

    judge.__name__ = judge.__qualname__ = "judge"
    judge.take_metrics = take_metrics
    return judge


def _image_parts(media: torch.Tensor, frames) -> list[dict]:
    """The chosen frames of an image/video completion as PNG data-URL ``image_url`` parts;
    a tensor that is no image in [0, 1] raises ValueError (a failed sample, counted)."""
    import io

    from PIL import Image

    chosen = select_frames(media, frames)
    if not bool(torch.isfinite(chosen).all()):
        raise ValueError("judge: the image has non-finite pixels")
    parts = []
    for frame in chosen:
        pixels = (frame.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _content(text: str, images: list[dict] | None) -> str | list[dict]:
    """A user message's content: the text alone, or the text then the image parts."""
    return text if images is None else [{"type": "text", "text": text}, *images]


def _scale(scale: Any) -> tuple[float, float]:
    if (
        not isinstance(scale, (list, tuple))
        or len(scale) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scale)
        or not all(math.isfinite(v) for v in scale)
        or not scale[0] < scale[1]
    ):
        raise RewardConfigError(
            f"judge: scale must be [low, high] with finite low < high, got {scale!r}"
        )
    return float(scale[0]), float(scale[1])


def _prompt_text(prompt: Any) -> str:
    """A chat prompt (a list of {role, content} messages) as "role: content" lines; text as is."""
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) for m in prompt):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def _retry_after(resp: httpx.Response) -> float:
    try:
        return float(resp.headers.get("retry-after", 0.0))
    except ValueError:  # an HTTP date: fall back to the exponential wait
        return 0.0


def _collect(
    results: Mapping[str, Any], keys: Sequence[str], completions: Sequence[str]
) -> list[float]:
    """Scores in batch order; NaN (a counted failure) where the judgement failed, logged."""
    out: list[float] = []
    logged = 0
    for i, key in enumerate(keys):
        result = results[key]
        if isinstance(result, _JudgeFailure):
            out.append(FailedScore(f"judge: no score ({scrub_text(result.reason)})"))
            level = logging.WARNING if logged < _LOGGED_FAILURES_PER_CALL else logging.DEBUG
            logged += 1
            logger.log(
                level,
                "judge: no score for sample %d (%s); judge reply: %s; response judged: %s",
                i,
                scrub_text(result.reason),
                _shown(result.reply),
                _shown(completions[i]),
            )
        else:
            out.append(float(result))
    return out


def _shown(text: Any) -> str:
    if isinstance(text, torch.Tensor):
        return f"<image {'x'.join(map(str, text.shape))}>"
    text = scrub_text(text or "")
    return repr(text if len(text) <= _REPLY_SHOWN else text[: _REPLY_SHOWN - 3] + "...")
