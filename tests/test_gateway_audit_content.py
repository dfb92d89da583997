"""`--audit-content`: the audit record of a request holds its prompt and its answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.live_server import MODEL_NAME, LiveServer


def test_audit_content_keeps_prompt_and_output(llama_dir: Path, tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    server = LiveServer(llama_dir, ["--audit-content", "--audit-dir", str(audit)])
    server.start(tmp_path / "server.log")
    try:
        body = {
            "model": MODEL_NAME,
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Café au lait, s'il vous plaît"}],
        }
        reply = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        assert server.stop() == 0  # SIGTERM flushes the audit log
    records = [json.loads(line) for line in (audit / "audit.jsonl").read_text().splitlines()]
    [record] = [r for r in records if r["status"] == 200]
    assert "Café au lait, s'il vous plaît" in record["prompt"]
    assert record["output"] == reply.json()["content"][0]["text"]
    assert record["output_tokens"] == reply.json()["usage"]["output_tokens"]
    keys_db = tmp_path / "data" / "zerohop" / "keys.db"  # the server's key store: the head
    verify = [sys.executable, "-m", "zerohop", "audit", "verify", str(audit), "--keys-db", keys_db]
    done = subprocess.run(verify, capture_output=True, text=True, check=False)
    assert done.returncode == 0
    assert done.stdout == f"ok: {len(records)} records in 1 files\n", done.stderr
    assert "no chain head recorded" not in done.stderr  # --audit-dir's head is in the store
