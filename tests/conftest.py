import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# A measured matmul plan (layers/matmul_plan.py) would make the path a step takes, and so whether the decoder
# stack serves it, depend on this machine's load while the plan is timed; tests that measure ask for it.
os.environ.setdefault("TOKENMILL_MATMUL", "panel")
logging.getLogger("tokenmill").setLevel(logging.INFO)


@pytest.fixture(scope="session")
def tiny():
    """arch -> path of a tiny random model dir (built once per session)."""
    from models import tiny_model

    return tiny_model
