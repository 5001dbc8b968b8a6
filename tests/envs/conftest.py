"""Fixtures of the env tests."""

from __future__ import annotations

import os

import pytest

from turnforge.errors import UserError


@pytest.fixture(scope="module")
def browser_ok():
    """Chromium, Playwright and the miniwob pages are there; else skip naming `make setup` (fail under CI=true)."""
    why = None
    try:
        import miniwob  # noqa: F401
        import playwright.sync_api  # noqa: F401
    except ImportError as err:
        why = f"{err.name} is missing"
    if why is None:
        try:
            from turnforge.envs.web.browser import chromium_path

            chromium_path()
        except UserError as err:
            why = str(err)
    if why is not None:
        message = f"{why}: run `make setup` (it installs chromium and the web extra)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
