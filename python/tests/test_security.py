"""The servers of the session cluster require the API key (conftest.API_KEY) for mutating
requests; the clients send it from the environment (issue 13, defect 18)."""

from __future__ import annotations

import pytest

import rolloutcore


def test_without_the_key_mutations_are_refused_and_reads_stay_open(cluster):
    before = cluster.controller.status()
    anonymous = rolloutcore.ControllerClient(cluster.controller_url, api_key="")
    with pytest.raises(rolloutcore.UnauthenticatedError):
        anonymous.request_update(cluster.model, "v0")
    engine = rolloutcore.EngineClient(cluster.engine_url, api_key="wrong")
    with pytest.raises(rolloutcore.UnauthenticatedError):
        engine.pause()
    assert anonymous.status() == before  # reads need no key, and nothing changed
    assert not cluster.engine.state()["paused"]

