"""`tokenmill serve`'s arguments in one place (engine, HTTP server, data parallel): the CLI's subcommand adds
them, and the fleet launchers and the tuner check a `tokenmill serve` command they will start against the same
arguments without importing the CLI, which sits above them."""
from __future__ import annotations

import argparse
import contextlib
import io

from tokenmill.config import EngineConfig
from tokenmill.fleet.data_parallel import add_data_parallel_args
from tokenmill.serve.args import add_serve_args


def add_serve_command_args(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    add_serve_args(p)
    add_data_parallel_args(p)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill serve", add_help=False)
    add_serve_command_args(p)
    return p


def serve_flags() -> set[str]:
    """Every flag `tokenmill serve` takes."""
    return {s for action in _parser()._actions for s in action.option_strings}  # argparse lists no actions


def check_serve_argv(argv: list[str]) -> None:
    """Raises ValueError with argparse's reason when `tokenmill serve <argv>` would not parse."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            _parser().parse_args(argv)
    except SystemExit:  # argparse's message is the last line it wrote
        raise ValueError((said.getvalue().strip().splitlines() or ["?"])[-1].removeprefix("tokenmill serve: error: "))
