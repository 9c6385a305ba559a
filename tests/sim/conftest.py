"""The measured A100 profiles live in ../shared/data (or $CONTINUUM_DATA_DIR)."""

from __future__ import annotations

import pytest

from sim.cost_model import StepCostModel
from sim.data import data_dir


@pytest.fixture(scope="session")
def cost() -> StepCostModel:
    if not (data_dir() / "profiles" / "a100" / "llama3_70b_mlp.csv").exists():
        pytest.skip(f"A100 operator profiles not found under {data_dir()}")
    return StepCostModel()
