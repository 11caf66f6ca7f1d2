"""`tokenmill generate` as a user runs it: streams text; bad input is a one-line error."""
import subprocess
import sys


def _run(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_streams_text(tiny):
    r = _run("generate", tiny("llama"), "--prompt", "The quick brown fox", "--max-tokens", "8", "--ignore-eos",
             "--dtype", "float32", "--kv-cache-memory-bytes", "16MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text streamed"
    assert "8 tokens" in r.stderr and "first token" in r.stderr


def test_bad_model_is_one_line_error(tmp_path):
    r = _run("generate", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("tokenmill: error:")]
    assert len(lines) == 1 and "nope" in lines[0]
    assert "Traceback" not in r.stderr
