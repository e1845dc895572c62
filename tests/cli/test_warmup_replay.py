"""`umbp-nvme warmup --replay`: against a stand-in SGLang server on 127.0.0.1 that records requests."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

import umbp_nvme.cli.main as cli


class _Recorder(http.server.BaseHTTPRequestHandler):
    received: list = []
    lock = threading.Lock()
    in_flight = 0
    max_in_flight = 0
    fail_text = None
    hold_until = 0  # > 0: the first requests wait (up to 30 s) until this many are in flight at once
    overlapped: threading.Event

    def do_POST(self):  # noqa: N802 - http.server's name
        n = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(n))
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
            cls.received.append((self.path, body))
            if cls.in_flight >= cls.hold_until:
                cls.overlapped.set()
        # overlap seen by the server, not hoped for from a sleep: a replay that sends one request
        # at a time leaves the first waiting here 30 s (then no one waits), and max_in_flight stays low
        if not cls.overlapped.wait(30):
            cls.overlapped.set()
        with cls.lock:
            cls.in_flight -= 1
        if cls.fail_text is not None and body.get("text") == cls.fail_text:
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"text": "x", "meta_info": {"prompt_tokens": 10, "cached_tokens": 4}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    handler = type("H", (_Recorder,), {"received": [], "lock": threading.Lock(), "in_flight": 0, "max_in_flight": 0,
                                       "overlapped": threading.Event()})  # fmt: skip
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd, handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_replay_sends_every_prompt_to_generate_with_one_new_token_n_in_flight(tmp_path, capsys, server):
    httpd, h = server
    h.hold_until = 4  # the first requests answer once four are in flight together
    prompts = tmp_path / "prompts.jsonl"
    lines = ['"plain string prompt"', json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 50, "top_p": 0.9}}),
             json.dumps({"prompt": "from prompt field"}), json.dumps({"input_ids": [1, 2, 3]}), ""]
    lines += [json.dumps({"text": f"p{i}"}) for i in range(12)]
    prompts.write_text("\n".join(lines) + "\n")
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    rc = cli.main(["warmup", "--replay", str(prompts), "--server", url, "--concurrency", "4", "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (s["sent"], s["ok"], s["failed"]) == (16, 16, 0)
    assert s["prompt_tokens"] == 160 and s["cached_tokens"] == 64
    assert all(path == "/generate" for path, _ in h.received)
    bodies = [b for _, b in h.received]
    assert all(b["sampling_params"]["max_new_tokens"] == 1 for b in bodies)
    assert {b.get("text") for b in bodies} >= {"plain string prompt", "hello", "from prompt field"}
    assert [1, 2, 3] in [b.get("input_ids") for b in bodies]
    assert next(b for b in bodies if b.get("text") == "hello")["sampling_params"]["top_p"] == 0.9
    assert h.max_in_flight == 4  # --concurrency 4: four at once, never a fifth


def test_replay_counts_server_errors_and_exits_1(tmp_path, capsys, server):
    httpd, h = server
    h.fail_text = "bad"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"good"\n"bad"\n')
    rc = cli.main(["warmup", "--replay", str(prompts), "--server", f"127.0.0.1:{httpd.server_address[1]}", "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 1 and (s["ok"], s["failed"]) == (1, 1)
    assert any("HTTP 500" in e for e in s["errors"])


def test_replay_to_an_unreachable_server_names_the_url(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"x"\n')
    import socket

    with socket.socket() as sk:  # a port nobody listens on
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    rc = cli.main(["warmup", "--replay", str(prompts), "--server", f"http://127.0.0.1:{port}", "--timeout", "5", "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 1 and s["failed"] == 1
    assert f"127.0.0.1:{port}/generate" in s["errors"][0] and "--server" in s["errors"][0]


def test_replay_refuses_a_malformed_prompt_line_with_its_line_number(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"ok"\n{"nope": 1}\n')
    rc = cli.main(["warmup", "--replay", str(prompts), "--server", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{prompts}:2" in err
