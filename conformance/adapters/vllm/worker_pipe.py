"""The worker's pipe to adapter.py: one JSON request per line on stdin, one JSON answer per line on the
original stdout, which `claim_stdout` keeps for the answers alone. Part of the worker (worker.py): runs in vLLM's
environment, imports only the standard library."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def claim_stdout():
    """The protocol channel is the original stdout; everything else (vLLM's logging, warnings) goes to stderr.
    worker.py calls it before importing torch or vLLM, so that nothing they print can reach the channel."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def requests():
    """The adapter's requests, one per line, until it closes the pipe."""
    for line in sys.stdin:
        yield json.loads(line)


def send(channel, answer: dict) -> None:
    channel.write(json.dumps(answer) + "\n")


def answer_requests(channel, ops: dict, name: str, before=None) -> None:
    """Each request answered by its op until `quit` or the pipe closes; a failure answered with vLLM's own words
    in one line (first_line), its traceback to stderr. `before(req)`: run first on every request."""
    for req in requests():
        t0 = time.time()
        try:
            if req["op"] == "quit":
                break
            if before is not None:
                before(req)
            answer = {"ok": True, **ops[req["op"]](req)}
        except Exception as exc:
            traceback.print_exc()
            answer = {"ok": False, "error": type(exc).__name__, "message": first_line(exc)}
        answer["seconds"] = round(time.time() - t0, 3)
        print(f"[{name}] {req['op']} {answer['seconds']}s ok={answer['ok']}", file=sys.stderr, flush=True)
        send(channel, answer)


DETAIL = 200   # characters of a validation error's detail kept (vLLM's registry refusal lists ~400 architectures)


def first_line(exc: BaseException) -> str:
    """One line of what vLLM raised. pydantic's ValidationError (vLLM's config classes) says only "1 validation
    error for SpeculativeConfig" on its first line, the cause on the next: its first error's message is added,
    cut to DETAIL characters, so that a registry entry can tell one refusal from another."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(errors) and errors():
        detail = (str(errors()[0].get("msg", "")).splitlines() or [""])[0]
        line += f": {detail[:DETAIL]}" + ("..." if len(detail) > DETAIL else "")
    return line
