"""A tool and a response format the agent tests share."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                           "days": {"type": "integer", "enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip


class Answer(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]
