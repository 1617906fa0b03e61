"""bench/bench_serving.py's raw load generator: answers split across reads or several
in one read are each counted once with their status, and a real server (uvicorn
over the app, a tiny memory) answers its prepared requests as httpx sees them."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
pytest.importorskip("fastapi")
bench_serving = pytest.importorskip("bench_serving")


def _answer(status: int, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\ncontent-type: application/json\r\n\r\n"
            ).encode() + body


def test_answers_split_anywhere_or_pipelined_are_parsed_once_each():
    async def run() -> list[str]:
        conn = bench_serving.RawConnection()

        class T:  # a transport that records writes
            def __init__(self):
                self.sent = []

            def write(self, b):
                self.sent.append(b)

        conn.connection_made(T())
        stream = _answer(200, b'{"hits": []}') + _answer(503, b'{"detail": "full"}') + _answer(204, b"")
        got = []
        for cut in range(1, len(stream)):  # every split of the three answers into two reads
            conn.buf.clear()
            f1 = conn.request(b"req")
            conn.data_received(stream[:cut])
            conn.data_received(stream[cut:])
            got.append(f1.result() if f1.done() else None)
            for _ in range(2):  # the other two answers are in the buffer already
                f = conn.request(b"req")
                conn.data_received(b"")
                got.append(f.result() if f.done() else None)
        return got

    got = asyncio.run(run())
    assert got == ["200", "503", "204"] * (len(got) // 3) and len(got) % 3 == 0 and got


def test_a_closed_connection_fails_its_waiting_request():
    async def run() -> None:
        conn = bench_serving.RawConnection()
        conn.connection_made(type("T", (), {"write": lambda self, b: None})())
        fut = conn.request(b"req")
        conn.connection_lost(None)
        with pytest.raises(ConnectionResetError):
            await fut
        with pytest.raises(ConnectionResetError):  # and every later request at once
            await conn.request(b"req")

    asyncio.run(run())


def test_the_raw_client_drives_a_real_server(tmp_path):
    uvicorn = pytest.importorskip("uvicorn")
    from _serving_helpers import HashEncoder

    from rfmem_fast import Memory
    from rfmem_fast.serving.app import create_app

    mem = Memory(tmp_path / "m", encoder=HashEncoder(16), max_wait_ms=0.5)
    mem.add(["tea", "coffee", "rain"], "a/b", ids=["1", "2", "3"])
    port = bench_serving.free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(mem, no_auth=True), host="127.0.0.1", port=port,
                                           log_level="warning", timeout_keep_alive=0.2))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.02)
        work = [("tea", "a/b"), ("rain", "a/b"), ("x", "nobody")] * 10
        res = bench_serving.run_async(bench_serving.drive(f"http://127.0.0.1:{port}", work, 4, 2, "raw"))
        assert res["requests"] == len(work) and res["errors"] == {}
        bad = bench_serving.run_async(bench_serving.drive(f"http://127.0.0.1:{port}", [("", "a/b")] * 3, 2, 2, "raw"))
        assert bad["requests"] == 0 and bad["errors"] == {"400": 3}  # a blank query: 400, counted as an error

        async def stale() -> list[str]:  # connections the server closed while idle are not reused
            async with bench_serving.RawClient(f"http://127.0.0.1:{port}", 0) as raw:
                first = await asyncio.gather(*(raw.one("a%2Fb", b'{"query": "tea"}') for _ in range(3)))
                await asyncio.sleep(0.6)  # past the server's keep-alive timeout
                return first + list(await asyncio.gather(*(raw.one("a%2Fb", b'{"query": "tea"}') for _ in range(3))))

        assert bench_serving.run_async(stale()) == ["200"] * 6
    finally:
        server.should_exit = True
        t.join(10)
        mem.close()
