"""The calculator environment's action and observation (OpenEnv's pydantic models)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class CalcAction(Action):
    """One model turn: a tool call ``<calc>347*582</calc>`` (the closing tag may be cut by a stop
    string) or the final answer."""

    message: str = Field(..., description="the model's text")


class CalcObservation(Observation):
    """The problem after ``reset``; the calculator's result after a tool call."""

    text: str = Field(default="", description="what the model reads next")
