"""Fixtures of the serve tests: ``sdm-mlx serve`` on the tiny SDM network of the ``setup`` fixture
(tests/conftest.py), one server per test module, and the official ``openai`` client pointed at it.
A test module that needs other server flags defines its own ``server`` (tests/serve/test_serve.py)."""

from __future__ import annotations

import signal

import pytest

from server_process import ServerProcess, sdm_mlx  # tests/helpers/

CLIENT_TIMEOUT = 120


@pytest.fixture(scope="module")
def server(setup):
    """``sdm-mlx serve --head`` on the tiny network, default settings; stopped with SIGTERM (exit 0) after the module."""
    srv = ServerProcess(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, "--quiet"))
    try:
        yield srv
        assert srv.stop(signal.SIGTERM) == 0, "".join(srv.lines)
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)
