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
# The suite's throwaway models (a 1.4 GB MoE built per session, float copies of GGUFs) would each add a file of
# their size to the user's weight cache (models/weight_cache.py never evicts): one suite run grew it by GBs.
# test_weight_cache.py turns it on in a temporary cache of its own.
os.environ.setdefault("TOKENMILL_WEIGHT_CACHE_MIN_MB", "off")
logging.getLogger("tokenmill").setLevel(logging.INFO)


@pytest.fixture(scope="session")
def tiny():
    """arch -> path of a tiny random model dir (built once per session)."""
    from models import tiny_model

    return tiny_model
