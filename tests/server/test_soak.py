"""The soak script for a minute against the built-in default model on the CPU: every check holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
DURATION_S = 60


def test_soak_one_minute(tmp_path):
    out = tmp_path / "soak.json"
    # four workers and a few tokens per request: the CI machine runs other tests beside this one
    cmd = [sys.executable, str(SCRIPT), "--duration", str(DURATION_S), "--concurrency", "4", "--max-tokens", "8",
           "--seed", "1", "--out", str(out), "--server-log", str(tmp_path / "server.log")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DURATION_S + 600)
    assert out.exists(), f"no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(out.read_text())
    checks = summary["checks"]
    failed = {name: check for name, check in checks.items() if check["ok"] is False}
    context = json.dumps({"failed": failed, "failures": summary["failures"][:10]}, indent=1)

    # the acceptance: no 5xx (bad inputs too: lone surrogates, a 20 MB body), no hang, pages and
    # requests back to where they were, the server's memory flat after the warm-up
    assert checks["server_alive"]["ok"], context
    assert checks["no_5xx"]["ok"] and summary["errors"]["5xx"] == 0, context
    assert checks["no_hangs"]["ok"] and summary["errors"]["timeouts"] == 0, context
    assert checks["pages_baseline"]["ok"], context
    final = checks["pages_baseline"]["final"]
    assert final["running"] == final["waiting"] == final["pages_requests"] == final["sessions"] == 0, context
    assert checks["rss_growth"]["ok"] is True and checks["rss_growth"]["growth_pct"] < 5, context
    assert summary["ok"] and proc.returncode == 0, context

    # the run did what it claims: a real mix, every bad input sent and refused with a 4xx
    kinds = summary["requests"]["by_kind"]
    assert summary["requests"]["sent"] >= 50
    for kind in ("completion", "chat", "completion_stream", "chat_stream", "session_create", "session_turn",
                 "leave_stream", "leave_plain"):
        assert kinds.get(kind, {}).get("n", 0) >= 1, f"no {kind} request in a minute"
    bad = {k: v for k, v in kinds.items() if k.startswith("bad:")}
    assert {f"bad:{name}" for name in summary["bad_inputs"]} <= bad.keys()
    for kind, row in bad.items():
        assert all(code.isdigit() and 400 <= int(code) < 500 for code in row["outcomes"]), (kind, row)
    assert summary["series"] and summary["series"][-1]["t"] >= DURATION_S
    assert summary["rss_mb"]["max"] > 0
