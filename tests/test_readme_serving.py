"""The HTTP guide (docs/guides/http.md) runs as written: its curl commands against a live
HTTP server started with the guide's ``rfmem serve`` flags. (The serving guides' Python
examples, each commented print checked against its output, run in tests/test_readme.py.)"""
from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import threading
import time

import pytest

from _doc_blocks import DOCS, fenced

HTTP_GUIDE = DOCS / "guides" / "http.md"


def blocks(lang: str) -> list[str]:
    return fenced(HTTP_GUIDE.read_text(encoding="utf-8"), lang)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serving_http_examples_run(tmp_path, text_encoder):
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from rfmem_fast import Memory
    from rfmem_fast.cli import build_parser
    from rfmem_fast.serving.app import create_app

    bash = [b for b in blocks("bash")]
    serve_block = next(b for b in bash if "rfmem serve" in b)
    key = re.search(r"^export RFMEM_API_KEY=(\S+)", serve_block, re.M).group(1)
    line = next(ln for ln in serve_block.splitlines() if ln.startswith("rfmem serve"))
    args = build_parser().parse_args(shlex.split(line)[1:])  # the guide's flags parse
    assert args.command == "serve" and args.port == 8000
    port = _free_port()
    mem = Memory(tmp_path / args.path, encoder=text_encoder)
    server = uvicorn.Server(uvicorn.Config(create_app(mem, api_key=key), host=args.host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        outputs = []
        for block in (b for b in bash if "curl" in b):
            run = subprocess.run(["bash", "-euo", "pipefail", "-c", block.replace(":8000", f":{port}")],
                                 capture_output=True, text=True, timeout=60, env={"RFMEM_API_KEY": key, "PATH": "/usr/bin:/bin"})
            assert run.returncode == 0, run.stderr
            outputs.append(run.stdout)
    finally:
        server.should_exit = True
        thread.join(30)
        mem.close()
    added, found, rest, health = outputs
    assert len(json.loads(added)["ids"]) == 2
    reply = json.loads(found)
    hit = reply["hits"][0]
    assert hit["text"] == "I moved to Lyon in 2021." and hit["metadata"] == {"source": "chat"}
    dec = json.JSONDecoder()
    listed, end = dec.raw_decode(rest)  # curl prints the bodies without newlines
    deleted, end2 = dec.raw_decode(rest, end)
    metrics = rest[end2:]
    assert [it["text"] for it in listed["items"]][0] == "I moved to Lyon in 2021."
    assert deleted == {"detail": "ids: user 'alice' holds no item id 'no-such-id'"}
    assert 'rfmem_cache_hit_ratio{cache="results"}' in metrics and "rfmem_batch_size_count 1.0" in metrics
    # the guide's sample replies: the server's fields, each of the JSON type the server sends
    search_block = next(b for b in bash if "/search" in b)
    health_block = next(b for b in bash if "/health" in b)
    doc_search, doc_health = documented_reply(search_block), documented_reply(health_block)
    assert same_shape(doc_search, reply) and same_shape(doc_health, json.loads(health))
    for key in ("user_id", "route", "rule", "rounds", "cached"):  # what the default configuration answers
        assert doc_search[key] == reply[key], key
    assert {k: doc_search["hits"][0][k] for k in ("text", "metadata", "rank")} == {
        k: hit[k] for k in ("text", "metadata", "rank")}
    real_health = json.loads(health)
    assert {k: v for k, v in doc_health.items() if k != "encoder"} == {
        k: v for k, v in real_health.items() if k != "encoder"}
    assert doc_health["encoder"]["dim"] == real_health["encoder"]["dim"] and doc_health["encoder"]["loaded"]


def documented_reply(block: str) -> dict:
    """The JSON a guide's curl block shows in its ``# {...}`` comment lines (numbers shortened
    as ``0.2...`` read as 0.2; a note after the object, ``(201, ...)``, left out)."""
    text = " ".join(ln.lstrip("#").strip() for ln in block.splitlines() if ln.lstrip().startswith("#"))
    text = re.sub(r"(\d)\.\.\.", r"\1", text)
    return json.JSONDecoder().raw_decode(text)[0]


def _kind(v) -> str:
    """The JSON type of a parsed value (int and float both "number")."""
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__


def same_shape(doc, real, where: str = "reply") -> bool:
    """Whether the documented JSON has exactly the real reply's keys (recursively; lists by
    their first element), each value of the same JSON type (int and float both numbers)."""
    assert _kind(doc) == _kind(real), f"{where}: the guide shows {doc!r}, the server sends {real!r}"
    if isinstance(doc, dict):
        assert set(doc) == set(real), f"{where}: the guide shows keys {sorted(doc)}, the server sends {sorted(real)}"
        return all(same_shape(doc[k], real[k], f"{where}.{k}") for k in doc)
    if isinstance(doc, list) and doc and real:
        return same_shape(doc[0], real[0], f"{where}[0]")
    return True
