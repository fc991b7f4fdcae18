"""Hypothesis profiles for the suite: pick one with HYPOTHESIS_PROFILE (default, ci, long)."""

from __future__ import annotations

import gc
import os

from hypothesis import HealthCheck, settings

# the Redis and S3 servers of the store tests (fixtures redis_url, s3_url, own_redis)
pytest_plugins = ["services"]

settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=300,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=5000,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# ---------------------------------------------------------------- every graph round-trips
# Each graph a test builds is saved and loaded back when the test ends, and must come back
# the same: export (messages, discarded turns), token fields, stats and links. The check runs
# once per graph shape in a session (see round_trips.py); ROLLOUT_STORE_ROUND_TRIP=every
# checks every graph.

from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from round_trips import RoundTrips  # noqa: E402

from rollout_store import RolloutGraph  # noqa: E402

_ROUND_TRIPS = pytest.StashKey[RoundTrips]()
_SLOW_DESELECTED = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    every = os.environ.get("ROLLOUT_STORE_ROUND_TRIP", "") == "every"
    config.stash[_ROUND_TRIPS] = RoundTrips(every=every)
    config.stash[_SLOW_DESELECTED] = 0
    _slow_tests_in_one_process(config)


def _slow_tests_in_one_process(config: pytest.Config) -> None:
    """A run that selects the slow tests (`-m slow`) runs in this process, unless its
    command line asks for workers (`-n`): several of them measure the machine, which
    workers beside them would load. (`addopts` asks for workers for the fast tests; this
    runs before pytest-xdist sets its workers up, which it does last.)"""
    marks = config.getoption("markexpr", "") or ""
    if "slow" not in marks.replace("not slow", ""):
        return
    asked = config.invocation_params.args
    if any(
        arg in ("-n", "--numprocesses") or arg.startswith(("-n", "--numprocesses="))
        for arg in asked
    ):
        return
    if getattr(config.option, "numprocesses", None) is not None:
        config.option.numprocesses = 0
        config.option.dist = "no"
        config.option.tx = []


@pytest.fixture(autouse=True)
def every_graph_round_trips(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    built: list[RolloutGraph] = []
    original = RolloutGraph.__init__

    def recording_init(self: RolloutGraph, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(RolloutGraph, "__init__", recording_init)
    yield
    monkeypatch.undo()
    if built:
        round_trips = request.config.stash[_ROUND_TRIPS]
        round_trips.check(built, tmp_path_factory.mktemp("roundtrip"))


# ---------------------------------------------------------------- one TLS context
# Every httpx client (the tests' own calls; the openai SDK's; the anthropic SDK's, through its
# fork httpx2) loads the CA bundle into a new TLS context when it is made: 30 ms of CPU, paid
# about a thousand times a run by clients that only speak plain HTTP to loopback. The run
# makes one per setting and hands it to every client.


def _made_once(create: Any) -> Any:
    made: dict[Any, Any] = {}

    def once(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, *(os.environ.get(k) for k in ("SSL_CERT_FILE", "SSL_CERT_DIR")))
        if key not in made:
            made[key] = create(verify=True, trust_env=trust_env)
        return made[key]

    return once


@pytest.fixture(autouse=True, scope="session")
def one_tls_context_for_http_clients() -> Iterator[None]:
    import importlib

    with pytest.MonkeyPatch.context() as patch:
        for name in ("httpx._transports.default", "httpx2._transports.default"):
            try:
                transports = importlib.import_module(name)
            except ImportError:  # httpx2 comes with the anthropic SDK's newer releases
                continue
            create = getattr(transports, "create_ssl_context", None)
            if create is not None:  # (else a release that makes them otherwise: left alone)
                patch.setattr(transports, "create_ssl_context", _made_once(create))
        yield


# ---------------------------------------------------------------- a heap collected once
# Collecting the suite imports the SDKs, hypothesis and the test modules: some 300,000 objects
# that live as long as the run. Each full collection walked them all again (a tenth to half a
# second: the memory tests collect before they measure, and the collector runs on its own).
# Once collected, they are set aside (`gc.freeze`): later collections walk what tests made.


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


# ---------------------------------------------------------------- what the run left out


def pytest_deselected(items: list[pytest.Item]) -> None:
    slow = sum(1 for item in items if item.get_closest_marker("slow") is not None)
    if items and slow:
        items[0].config.stash[_SLOW_DESELECTED] += slow


# With pytest-xdist the workers collect and run the tests: each hands its figures back when it
# ends (`workeroutput`), and the controller, which ran none, adds them up for the summary.


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # a worker
        round_trips = session.config.stash[_ROUND_TRIPS]
        output["slow_deselected"] = session.config.stash[_SLOW_DESELECTED]
        output["round_trips"] = (round_trips.checked, round_trips.skipped)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    output = getattr(node, "workeroutput", None)
    if not output or "round_trips" not in output:  # (a worker that died says nothing)
        return
    config = node.config
    # every worker collects every test, so each deselected the same slow ones
    config.stash[_SLOW_DESELECTED] = max(config.stash[_SLOW_DESELECTED], output["slow_deselected"])
    checked, skipped = output["round_trips"]
    config.stash[_ROUND_TRIPS].checked += checked
    config.stash[_ROUND_TRIPS].skipped += skipped


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    slow = config.stash.get(_SLOW_DESELECTED, 0)
    if slow:
        terminalreporter.write_line(
            f"{slow} slow tests (stress, fuzz, browser, subprocess servers) were left out; "
            "run them with: python -m pytest -q -m slow"
        )
    round_trips = config.stash.get(_ROUND_TRIPS, None)
    if round_trips is not None and round_trips.checked:
        every = "every graph" if round_trips.every else "once per graph shape"
        terminalreporter.write_line(
            f"save/load round trips ({every}): {round_trips.checked} graphs loaded and "
            f"compared, {round_trips.skipped} of a shape already checked saved only"
        )
