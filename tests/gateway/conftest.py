"""Fixtures of the gateway tests."""

from __future__ import annotations

import pytest


@pytest.fixture()
def recorded(monkeypatch):
    """Every rollout's gateway records, as the gateway closes it."""
    from turnforge.gateway import server

    out = {}
    close = server.Gateway.close_rollout

    def keep(self, rollout_id):
        out[rollout_id] = record = close(self, rollout_id)
        return record

    monkeypatch.setattr(server.Gateway, "close_rollout", keep)
    return out
