"""The one output-length policy (zerohop/api/serving/output_length.py): what each API does with a
`max_tokens` the context cannot hold, an absent one, and a prompt that leaves no room."""

from __future__ import annotations

import pytest

from zerohop.api.errors import ApiError
from zerohop.api.serving.output_length import OVERFLOW, Api, Overflow, output_limit

CONTEXT = 100
CLAMPED: list[Api] = ["messages", "responses"]
REFUSED: list[Api] = ["chat", "completions", "grpc"]


def test_every_api_has_a_rule() -> None:
    assert set(OVERFLOW) == {*CLAMPED, *REFUSED}
    assert {OVERFLOW[api] for api in CLAMPED} == {Overflow.CLAMP}
    assert {OVERFLOW[api] for api in REFUSED} == {Overflow.REFUSE}


@pytest.mark.parametrize("api", [*CLAMPED, *REFUSED])
def test_what_fits_is_kept_and_absent_is_up_to_the_context(api: Api) -> None:
    assert output_limit(api, 40, 60, CONTEXT) == 60
    assert output_limit(api, 40, 1, CONTEXT) == 1
    assert output_limit(api, 40, None, CONTEXT) is None


@pytest.mark.parametrize("api", CLAMPED)
def test_clamped_to_the_room_left(api: Api) -> None:
    assert output_limit(api, 40, 32_000, CONTEXT) == 60
    assert output_limit(api, 99, 32_000, CONTEXT) == 1


@pytest.mark.parametrize("api", REFUSED)
def test_refused_with_the_numbers(api: Api) -> None:
    with pytest.raises(ApiError) as info:
        output_limit(api, 40, 61, CONTEXT)
    error = info.value
    assert (error.status, error.param) == (400, "max_tokens")
    assert error.message == (
        "max_tokens is too large: 40 prompt tokens + 61 max_tokens = 101 > 100,"
        " this model's context"
    )


@pytest.mark.parametrize(
    ("api", "message"),
    [
        ("messages", "prompt is too long: 100 tokens > 99 maximum"),
        ("responses", "prompt is too long: 100 tokens > 99 maximum"),
        *[
            (
                api,
                "prompt is too long: 100 tokens, but this model's context is 100 tokens"
                " (prompt plus at least one output token)",
            )
            for api in REFUSED
        ],
    ],
)
def test_a_prompt_that_leaves_no_room_is_a_400_everywhere(api: Api, message: str) -> None:
    for max_tokens in (None, 1, 32_000):
        with pytest.raises(ApiError) as info:
            output_limit(api, CONTEXT, max_tokens, CONTEXT)
        assert (info.value.status, info.value.message) == (400, message)
