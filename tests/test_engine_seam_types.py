"""The engine's typed seam dicts stay in step with the dataclasses they carry: what the API
process reads by key (EngineStatsDict, EngineOptions) names exactly EngineStats' and
EngineConfig's fields, so the type checker's view of a key is the engine's."""

from __future__ import annotations

import dataclasses

import pytest

from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import EngineStats, EngineStatsDict
from zerohop.engine.config import EngineConfig


def test_stats_dict_keys_are_engine_stats_fields() -> None:
    fields = {f.name for f in dataclasses.fields(EngineStats)}
    assert set(EngineStatsDict.__annotations__) == fields


def test_as_dict_is_asdict() -> None:
    stats = EngineStats(
        num_blocks=8, blocks_in_use=3, blocks_cached=1, blocks_free=4, prefix_query_tokens=40,
        prefix_hit_tokens=16, num_running=2, num_waiting=1, step_times={"decode": [[1, 0.01]]},
        remaining_tokens=[3, 9], spec_draft_tokens=5,
    )  # fmt: skip
    as_dict = stats.as_dict()
    assert as_dict == dataclasses.asdict(stats)
    as_dict["step_times"]["decode"][0][1] = 1.0  # a copy: the engine's own table is untouched
    assert stats.step_times == {"decode": [[1, 0.01]]}


def test_engine_options_keys_are_engine_config_fields() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(EngineOptions.__annotations__) == fields


def test_zerohops_engine_refuses_vllm_args() -> None:
    with pytest.raises(ValueError, match="--engine vllm"):
        EngineConfig(vllm_args={"tensor_parallel_size": 2})
    EngineConfig(vllm_args={})  # none given: nothing to refuse
