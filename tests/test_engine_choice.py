"""`--engine`: auto picks zerohop's engine without a GPU, and a flag that belongs to the other
engine is refused at start in one line (never silently ignored)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.engines import require_vllm
from zerohop.cli.engine_choice import chosen_engine


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "zerohop", "serve", "tiny", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_auto_is_zerohops_engine_without_a_gpu() -> None:
    assert chosen_engine("auto") == "zerohop"  # these machines have no CUDA device
    assert chosen_engine("vllm") == "vllm" and chosen_engine("zerohop") == "zerohop"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tensor-parallel-size", "2"], "need --engine vllm"),
        (["--vllm-arg", "swap_space=4"], "need --engine vllm"),
        (["--quantization", "fp8"], "zerohop's engine takes auto, q8_0, none"),
        (["--engine", "vllm", "--inter-token-target", "0.2"], "--inter-token-target"),
        (["--engine", "vllm", "--batch-linger", "0.5"], "--batch-linger"),
    ],
)
def test_a_flag_of_the_other_engine_is_refused_at_start(args: list[str], message: str) -> None:
    if "vllm" in args:
        require_vllm()
    done = serve(*args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert message in lines[-1] and "Traceback" not in done.stderr


def test_a_vllm_argument_vllm_does_not_have_is_refused() -> None:
    require_vllm()
    from zerohop.engine.vllm.engine_args import VllmSetup
    from zerohop.models.tiny import tiny_model_dir

    with pytest.raises(ValueError, match="not an argument of vLLM's engine"):
        VllmSetup.from_options(str(tiny_model_dir()), {"vllm_args": {"no_such_field": 1}})


def test_zerohops_engine_flags_map_onto_vllms_arguments() -> None:
    require_vllm()
    from zerohop.engine.vllm.engine_args import SCHEDULER_CLS, engine_arguments

    options = {
        "max_num_seqs": 8,
        "dtype": "float32",
        "enable_prefix_caching": False,
        "num_kv_blocks": 64,
        "kv_cache_memory": 0.5,
        "quantization": "fp8",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "vllm_args": {"tensor_parallel_size": 2},
    }
    args = engine_arguments("/models/m", options, thinking=False)
    assert args["scheduler_cls"] == SCHEDULER_CLS
    assert args["structured_outputs_config"] == {"backend": "guidance"}
    assert args["max_num_seqs"] == 8 and args["dtype"] == "float32"
    assert args["enable_prefix_caching"] is False and args["num_gpu_blocks_override"] == 64
    assert args["kv_cache_memory_bytes"] == 2**29 and args["quantization"] == "fp8"
    assert args["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert args["tensor_parallel_size"] == 2
    assert "reasoning_config" not in args and "block_size" not in args
