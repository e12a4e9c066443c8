"""Fixtures of the deployment tests."""

from __future__ import annotations

import pytest

from tests.deploy.helm_chart import PROFILES, render


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request) -> tuple[str, dict | None, list[dict]]:
    """(name, values, the chart rendered with them) for each values profile of the chart tests."""
    return request.param, PROFILES[request.param], render(PROFILES[request.param])
