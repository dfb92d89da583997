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
