"""The upstream the capture server tests call: the stub engine, served once per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from capture_support import serve_app

from rollout_store.serve.stub_engine import create_stub_app


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    with serve_app(create_stub_app()) as url:
        yield url
