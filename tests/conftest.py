import json

import pytest
import torch

from specscope.models import load_target
from specscope.models.loading import PRESETS


def tiny_config(**overrides) -> dict:
    cfg = dict(PRESETS["tiny"])
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def smollm2():
    """The real bundled model (fp32, CPU), loaded once for the whole session."""
    return load_target("smollm2-135m", device="cpu")


@pytest.fixture
def make_random(tmp_path):
    """A random-weight target built through the real `random:<config.json>` path."""

    def make(seed=0, max_seq_len=512, num_slots=2, backend="native", **overrides):
        path = tmp_path / f"cfg{seed}_{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(tiny_config(**overrides)))
        return load_target(f"random:{path}", device="cpu", dtype=torch.float32, seed=seed,
                           max_seq_len=max_seq_len, num_slots=num_slots, backend=backend)

    return make
