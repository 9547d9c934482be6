"""Every sweep file in configs/sweeps/ loads, and every run it plans has a valid config (what `jopd sweep` checks
before its first run), so a typo in a shipped study fails here, not an hour into the sweep."""

from pathlib import Path

import pytest

from jopd.lab.sweep import check_configs, planned_runs
from jopd.lab.sweep_config import load_sweep

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_shipped_sweep_plans_valid_runs(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # sweep files name their base config relative to the repository
    sweep = load_sweep(str(path))
    assert len(planned_runs(sweep)) >= 2
    check_configs(sweep)


def test_there_are_sweep_files():
    assert len(SWEEPS) >= 5
