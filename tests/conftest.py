"""Session-wide fixtures: torch threads, the tiny models (each built once per session), and
the check that no error body the suite's servers send leaks internals (tests/error_bodies.py)."""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.error_bodies import ErrorRecord
from zerohop.api.http.error_record import ENV as ERROR_RECORD_ENV

TinyModelFactory = Callable[[str], Path]

# The `slow` tests, which `pytest -m "not slow"` skips (`make test` and CI run them all): the
# real default model (every test served by the `default_server` fixture, and its export to a
# Hugging Face folder), the five-replica fleet (every test on the `fleet` fixture) and the
# engine soak of 1000 random requests.
SLOW_FIXTURES = frozenset({"default_server", "default_engine_server", "fleet"})
SLOW_TESTS = frozenset(
    {
        "test_no_block_leaks_after_1000_random_requests",
        "test_the_default_model_exports",  # the real default model's export: ~26 s here
    }
)


# The `server` tests, which `make test-fast` (`-m "not server and not slow"`) leaves out: a
# test whose own code, any fixture it needs (transitively) or a helper of tests/ they call
# starts `zerohop serve` through these. One that starts it another way fails under the fast loop
# (ZEROHOP_TEST_FAST=1, see tests/live_server.py), naming itself, instead of slowing it.
SERVER_STARTERS = re.compile(r"\b(LiveServer|serve_on|started_together|fleet_of)\(")
CALLED_NAME = re.compile(r"\b([A-Za-z_]\w*)\(")
TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or getattr(item, "originalname", item.name) in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if starts_a_server(item):
            item.add_marker(pytest.mark.server)


def starts_a_server(item: pytest.Item) -> bool:
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixture closure
    if info is not None:
        for name in info.names_closure:
            functions += [definition.func for definition in info.name2fixturedefs.get(name, ())]
    return any(_calls_a_starter(f) for f in functions if f is not None)


@functools.cache
def _calls_a_starter(function: Callable[..., Any]) -> bool:
    """Whether `function`, or a helper of the test modules it calls by name, starts a server."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if SERVER_STARTERS.search(source):
        return True
    called = (getattr(function, "__globals__", {}).get(n) for n in set(CALLED_NAME.findall(source)))
    return any(_is_test_helper(f) and f is not function and _calls_a_starter(f) for f in called)


def _is_test_helper(value: object) -> bool:
    return inspect.isfunction(value) and Path(inspect.getfile(value)).parent == TESTS_DIR


@pytest.fixture(scope="session", autouse=True)
def error_record(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ErrorRecord]:
    record = ErrorRecord(tmp_path_factory.getbasetemp() / "error-bodies.jsonl")
    previous = os.environ.get(ERROR_RECORD_ENV)
    os.environ[ERROR_RECORD_ENV] = str(record.path)
    yield record
    if previous is None:
        os.environ.pop(ERROR_RECORD_ENV, None)
    else:
        os.environ[ERROR_RECORD_ENV] = previous
    record.check("after the last test (server shutdowns)")


@pytest.fixture(autouse=True)
def _error_bodies_leak_nothing(error_record: ErrorRecord) -> Iterator[None]:
    # Checked after each test, so a leak is reported on the test that caused it (or on the
    # first test of a module whose fixtures caused it).
    yield
    error_record.check("during this test")


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> None:
    # The machines have 2 cores shared with other jobs; torch's default oversubscribes.
    # Imported here, not at module level, so tests that need no model need no torch.
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`tiny_model("qwen2")` -> folder of that tiny model, built on first use."""
    from tests.fixtures.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(root / arch, arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_model: TinyModelFactory) -> dict[str, Path]:
    """Every tiny architecture, by name."""
    from tests.fixtures.tiny_models import ARCH_NAMES

    return {arch: tiny_model(arch) for arch in ARCH_NAMES}


@pytest.fixture(scope="session")
def llama_dir(tiny_model: TinyModelFactory) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def live_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One `zerohop serve` subprocess on the tiny llama, shared by the API tests. Its drain on
    SIGTERM is short: no test of it drains, and a stream one left open would otherwise hold
    the session's end for the default 30 s (LiveServer.stop warns of a slow stop)."""
    from tests.live_server import LiveServer

    log = tmp_path_factory.mktemp("server") / "server.log"
    server = LiveServer(llama_dir, ["--drain-seconds", "3"]).start(log)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """One real PostgreSQL (tests/postgres_server.py) for every store test module: each test
    makes its own databases in it. Tests that stop or kill it start it again."""
    from tests.pg_fixtures import postgres_server

    yield from postgres_server()


@pytest.fixture(scope="module")
def store_url(postgres: Any) -> str:
    """A migrated fleet store of the module's own in that PostgreSQL (its replicas share it)."""
    from tests.pg_fixtures import migrated_database

    return migrated_database(postgres)
