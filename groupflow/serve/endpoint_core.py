"""``EndpointCore``: what the endpoint mixins (``chat_endpoint``, ``completions_endpoint``) use of
``ServerCore`` (``serve.core``), declared for the type checker.

Design decision: the mixins cannot import ``ServerCore`` (it is made of them: an import cycle),
so the state they read and the shared steps they call are declared once here, as annotations and
``TYPE_CHECKING``-only signatures: at run time this class is empty, and every name is
``ServerCore``'s own (set in its ``__init__``, defined on it). A mixin that reaches for a name
not declared here is a type error, as a step's changed signature is where it is called.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import Access
from groupflow.serve.chat import ChatPrompts
from groupflow.serve.scoring import ScoreJob, TokenScores

__all__ = ["EndpointCore"]

_T = TypeVar("_T")


class EndpointCore:
    """``ServerCore``'s attributes and shared steps as its endpoint mixins see them."""

    tokenizer: Any  # a Hugging Face tokenizer
    model_name: str
    access: Access
    chat_prompts: ChatPrompts | None  # None: the tokenizer has no chat template

    if TYPE_CHECKING:  # defined on ServerCore (serve.core), which documents them

        async def _off_loop(self, chars: int, fn: Callable[..., _T], *args: Any) -> _T: ...

        def _check_chars(self, chars: int, param: str) -> None: ...

        def _params(self, key: str | None, req: Any, max_tokens: int | None, prompt_len: int,
                    token_param: str) -> SamplingParams: ...  # fmt: skip

        def _enqueue(self, key: str | None, jobs: list[tuple],
                     param: str) -> list[asyncio.Future]: ...  # fmt: skip

        async def _scores(self, jobs: list[ScoreJob], k: int, param: str) -> list[TokenScores]: ...

        def _text(self, ids: Sequence[int], stop: Sequence[str]) -> str: ...

        def _token(self, tid: int) -> str: ...
