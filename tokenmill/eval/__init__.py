"""Evaluation tools (`tokenmill eval ...`, wired in cli.py): quality.py measures what quantization costs
against the float model."""
