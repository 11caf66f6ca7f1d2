"""The package layout in numbers (issue 31), for the tree at any git revision, side by side:

- lines per top-level package (and the top-level modules together),
- functions over 60 lines, `Any` in annotations (parameters, returns, annotated names; nested ones count),
  imports of tokenmill modules inside functions,
- with --trace-chat REV...: the tokenmill files one chat request runs code in, API process and engine
  process, from a real `tokenmill serve` on the default model run from a checkout of REV (a sitecustomize.py on PYTHONPATH installs
  a profiler in both processes; SIGUSR1 arms it after a warm-up request, SIGUSR2 writes what it saw).

    python benchmarks/layout_stats.py --revs ca4da3d^ . --trace-chat ca4da3d^ .
Prints a JSON result and one summary line per revision.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tree_at(rev: str, into: str) -> pathlib.Path:
    """tokenmill/ as it is at `rev` ('.' for the working tree)."""
    if rev == ".":
        return ROOT / "tokenmill"
    archive = os.path.join(into, "tree.tar")
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", archive, rev, "tokenmill"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return pathlib.Path(into) / "tokenmill"


def _is_tokenmill_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").startswith("tokenmill")
    return isinstance(node, ast.Import) and any(a.name.startswith("tokenmill") for a in node.names)


def _annotations(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.annotation is not None:
                    yield arg.annotation
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def _any_count(annotation: ast.AST) -> int:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a string annotation
        try:
            annotation = ast.parse(annotation.value, mode="eval")
        except SyntaxError:
            return 0
    return sum(1 for n in ast.walk(annotation) if isinstance(n, ast.Name) and n.id == "Any"
               or isinstance(n, ast.Attribute) and n.attr == "Any")


def static_stats(pkg: pathlib.Path) -> dict:
    lines, long_functions, any_count, inner_imports = Counter(), [], 0, 0
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        text = path.read_text()
        lines[rel.parts[0] if len(rel.parts) > 1 else "(top-level modules)"] += text.count("\n")
        tree = ast.parse(text)
        any_count += sum(_any_count(a) for a in _annotations(tree))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if fn.end_lineno - fn.lineno + 1 > 60:
                long_functions.append(f"{rel}:{fn.name} ({fn.end_lineno - fn.lineno + 1})")
            # imports directly in this function's body (nested functions count for themselves)
            inner_imports += sum(1 for n in ast.walk(fn) if _is_tokenmill_import(n)
                                 and _enclosing(fn, n))
    return {"lines": dict(sorted(lines.items(), key=lambda kv: -kv[1])), "total_lines": sum(lines.values()),
            "functions_over_60_lines": long_functions, "any_in_annotations": any_count,
            "tokenmill_imports_inside_functions": inner_imports}


def _enclosing(fn: ast.AST, target: ast.AST) -> bool:
    """Whether `fn` is the innermost function around `target`."""
    for child in ast.iter_child_nodes(fn):
        if child is target:
            return True
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if _enclosing(child, target):
            return True
    return False


# -- the files a chat request runs code in ------------------------------------------------------------------
SITECUSTOMIZE = r'''
import os, signal, sys, threading
_seen, _armed = set(), [False]
_root = os.environ["TOKENMILL_TRACE_ROOT"]
def _prof(frame, event, arg):
    if _armed[0] and event == "call":
        f = frame.f_code.co_filename
        if f.startswith(_root):
            _seen.add(f[len(_root):])
def _arm(*_):
    _seen.clear(); _armed[0] = True
def _dump(*_):
    _armed[0] = False
    with open(os.path.join(os.environ["TOKENMILL_TRACE_OUT"], f"{os.getpid()}.json"), "w") as fh:
        import json; json.dump(sorted(_seen), fh)
signal.signal(signal.SIGUSR1, _arm)
signal.signal(signal.SIGUSR2, _dump)
sys.setprofile(_prof)
threading.setprofile(_prof)
'''


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out + [g for c in out for g in _children(c)]


def _chat(port: int) -> None:
    import httpx

    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()


def trace_chat(checkout: pathlib.Path, port: int = 8765) -> dict:
    """The files of checkout/tokenmill that one chat request runs code in."""
    out = tempfile.mkdtemp(prefix="chat-trace-")
    site = tempfile.mkdtemp(prefix="chat-trace-site-")
    pathlib.Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(checkout), os.environ.get("PYTHONPATH", "")]),
               TOKENMILL_TRACE_ROOT=str(checkout / "tokenmill") + os.sep, TOKENMILL_TRACE_OUT=out)
    server = subprocess.Popen([sys.executable, "-c", "import sys; from tokenmill.cli import main; sys.exit(main())",
                               "serve", "--port", str(port)], env=env, cwd=site,  # not this checkout's
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                _chat(port)  # the warm-up: first-call paths (compilation, caches) stay out of the count
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.5)
        pids = [server.pid, *_children(server.pid)]
        for pid in pids:
            _signal(pid, signal.SIGUSR1)
        time.sleep(0.5)
        _chat(port)
        time.sleep(0.5)
        for pid in pids:
            _signal(pid, signal.SIGUSR2)
        time.sleep(1.0)
    finally:
        server.terminate()
        server.wait(60)
    per_process = {p.stem: json.loads(p.read_text()) for p in pathlib.Path(out).glob("*.json")}
    api = per_process.get(str(server.pid), [])
    engine = sorted({f for pid, files in per_process.items() if pid != str(server.pid) for f in files})
    return {"api_process": api, "engine_process": engine, "files": len(set(api) | set(engine))}


def _signal(pid: int, sig: int) -> None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" in f.read():  # multiprocessing's helper has no handler: it would die
                return
        os.kill(pid, sig)
    except (OSError, ProcessLookupError):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--revs", nargs="+", default=["."], help="git revisions ('.' = the working tree)")
    ap.add_argument("--trace-chat", nargs="*", default=[], metavar="REV",
                    help="also trace one chat request on these revisions ('.' = the working tree)")
    args = ap.parse_args()
    result = {}
    for rev in args.revs:
        with tempfile.TemporaryDirectory() as tmp:
            result[rev] = static_stats(tree_at(rev, tmp))
        s = result[rev]
        print(f"{rev}: {s['total_lines']} lines, {len(s['functions_over_60_lines'])} functions over 60 lines, "
              f"{s['any_in_annotations']} Any in annotations, {s['tokenmill_imports_inside_functions']} tokenmill "
              "imports inside functions", file=sys.stderr)
    for rev in args.trace_chat:
        with tempfile.TemporaryDirectory() as tmp:
            checkout = ROOT if rev == "." else pathlib.Path(tmp) / "checkout"
            if rev != ".":
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), rev],
                               check=True, capture_output=True)
            try:
                result[f"chat_request@{rev}"] = trace_chat(checkout)
            finally:
                if rev != ".":
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkout)])
        print(f"{rev}: one chat request runs code in {result[f'chat_request@{rev}']['files']} tokenmill files",
              file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
