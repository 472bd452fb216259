"""The request bodies of `kvcli serve` (pydantic, strict: a string where a number belongs is a 400, not a
guess) and the one error a route raises, ApiError (status, message, param), that app.py turns into
OpenAI's error object."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from kvcli.sampler import Sampler


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        self.status, self.message, self.param = status, message, param


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None


class Sampling(_Body):
    """OpenAI's fields with llama-server's extras; None: kvcli run's default (llama.cpp's sampler)."""
    model: str | None = None
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's; -1: until end of generation
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-1)
    stop: Union[str, list[str], None] = None
    ignore_eos: bool = False  # llama-server's: end-of-generation tokens are never sampled
    n: int | None = Field(None, ge=1, le=1)  # one choice per request

    def sampler(self, eog_ids: frozenset[int] = frozenset()) -> Sampler:
        """The request's sampler; eog_ids: the model's end-of-generation ids, banned where ignore_eos."""
        d = Sampler.__dataclass_fields__
        pick = lambda v, name: d[name].default if v is None else v  # noqa: E731
        return Sampler(temp=pick(self.temperature, "temp"), top_k=pick(self.top_k, "top_k"),
                       top_p=pick(self.top_p, "top_p"), min_p=pick(self.min_p, "min_p"),
                       repeat_penalty=pick(self.repeat_penalty, "repeat_penalty"),
                       repeat_last_n=pick(self.repeat_last_n, "repeat_last_n"), seed=pick(self.seed, "seed"),
                       banned=eog_ids if self.ignore_eos else frozenset())

    def limit(self) -> int:
        for v in (self.max_tokens, self.max_completion_tokens, self.n_predict):
            if v is not None:
                return v
        return -1

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", "stop")
        return tuple(stops)


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionBody(Sampling):
    prompt: Union[str, list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeBody(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(_Body):
    tokens: list[int]
