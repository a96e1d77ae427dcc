"""A row's own sampling settings, as its overrides column holds them (a JSON object, or a
struct): checked here, so that a bad value is that row's error, not the engine's."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class RowOverrides(BaseModel):
    """One row's sampling overrides, as the overrides column holds them (a JSON object, or a
    struct). Checked here so that a bad value is that row's error, not the engine's."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    temperature: float = Field(None, ge=0, le=2)
    top_p: float = Field(None, gt=0, le=1)
    seed: int = Field(None)
    n: int = Field(None, ge=1, le=1024)
    stop: list[str] = None
    json_schema: dict = None
    # the logprobs column's top alternatives for this row; null: no logprobs
    logprobs: int | None = Field(None, ge=0, le=20)
    top_k: int = Field(None, ge=-1)  # -1 or 0: off, as in vLLM
    min_tokens: int = Field(None, ge=0)
    ignore_eos: bool = None
    repetition_penalty: float = Field(None, gt=0, le=2)
    presence_penalty: float = Field(None, ge=-2, le=2)
    frequency_penalty: float = Field(None, ge=-2, le=2)
    stop_token_ids: list[int] = None
    include_stop_str_in_output: bool = None  # vLLM's: the matched stop string kept in the text
    # OpenAI's logit_bias: token ids (JSON object keys, so strings) to a bias in [-100, 100]
    logit_bias: dict[str, float] = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_ids_and_biases(cls, value):
        return check_logit_bias(value)

    @classmethod
    def of(cls, value, struct: bool = False) -> dict:
        """The keys the row sets; ValueError in one line if the value is not valid. A struct
        column's row holds every field, with null for those the row does not set."""
        if value is None or value == "":
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("not a JSON object: " + repr(value[:60])) from None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object, got {type(value).__name__}")
        if struct:
            value = {k: v for k, v in value.items() if v is not None}
        try:
            parsed = cls.model_validate(value)
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            got = f" (got {first['input']!r})" if "input" in first and key else ""
            raise ValueError(f"{key}: {first['msg']}{got}"[:300]) from None
        return parsed.model_dump(include=parsed.model_fields_set)


def check_logit_bias(value):
    """OpenAI's logit_bias checked: token ids (JSON keys, so strings) to numbers in
    [-100, 100], as {"id": float}; ValueError says which entry is wrong."""
    if not isinstance(value, dict):
        return value
    for token, bias in value.items():
        if not str(token).isdigit():
            raise ValueError(f"{token!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise ValueError(f"token {token}: the bias must be a number from -100 to 100")
    return {str(k): float(v) for k, v in value.items()}
