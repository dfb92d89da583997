"""The prefix cache over a 10-turn Claude-Code-shaped session, this checkout against a baseline
tree: the cached fraction of each turn's prompt (cache_read_input_tokens / prompt tokens).

The session, through the official `anthropic` SDK (Messages API): a system prompt, the first
ask, then per turn a Read tool call, its tool_result with a `<system-reminder>` text block (as
Claude Code sends them) and a `role: "system"` message (`<total_tokens>`), the next request
replaying all of it. Answers are 1 token: the prompt is what is measured.

The model is the default one (SmolLM2-135M-Instruct, its Hugging Face export), served twice
per tree: with its own template (a system turn renders anywhere) and with that template
refusing a system turn after the first message (as Mistral's and Llama-2-style templates do),
where a server that hoists later system text into the leading prompt changes the prompt's
prefix every turn.

    .venv/bin/python benchmarks/session_prefix.py --baseline-tree /tmp/wt-base

Prints a table per template and writes bench-results/session_prefix.json (--out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anthropic
from _common import ROOT, print_table, write_json
from harness.ab import CURRENT, Tree
from harness.zerohop_server import SERVED_MODEL_NAME, ZerohopServer

from zerohop.models.default import default_model_path
from zerohop.models.hf_export import hf_folder_for

SYSTEM = "You are an agent for software engineering. Use the tools to read the code."
REFUSE_LATE = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system messages must come first') }}{% endif %}{% endfor %}"
)
TOOL = {
    "name": "Read",
    "description": "Read a file of the repository",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def session(turn: int) -> list[dict[str, Any]]:
    """Turn `turn`'s messages: the ask, then per earlier turn a call, its result with a
    reminder block, and a system message."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for k in range(1, turn):
        call = {"type": "tool_use", "id": f"toolu_{k}", "name": "Read",
                "input": {"path": f"src/module{k}.py"}}  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": f"toolu_{k}",
                  "content": f"def f{k}(x):\n    return x + {k}\n"}  # fmt: skip
        reminder = f"<system-reminder>The todo list has {k} open items.</system-reminder>"
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": f"Reading {k}."}, call]},
            {"role": "user", "content": [result, {"type": "text", "text": reminder}]},
            {"role": "system", "content": f"<total_tokens>{180000 - 900 * k} left</total_tokens>"},
        ]
    return messages


def run_session(url: str, turns: int) -> list[dict[str, int]]:
    client = anthropic.Anthropic(base_url=url, api_key="any", max_retries=0)
    usages = []
    for turn in range(1, turns + 1):
        usage = client.messages.create(
            model=SERVED_MODEL_NAME, max_tokens=1, system=SYSTEM, tools=[TOOL],  # type: ignore[list-item]
            messages=session(turn),  # type: ignore[arg-type]
        ).usage  # fmt: skip
        cached = usage.cache_read_input_tokens or 0
        usages.append({"prompt": usage.input_tokens + cached, "cached": cached})
    return usages


def model_folder(root: Path, refuse_late: bool) -> Path:
    """The default model's export, linked, with its template (refusing a later system turn)."""
    exported = hf_folder_for(default_model_path())
    folder = root / ("refuse-late" if refuse_late else "own")
    folder.mkdir()
    for part in exported.iterdir():
        if part.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (folder / part.name).symlink_to(part)
    config = json.loads((exported / "tokenizer_config.json").read_text())
    if refuse_late:
        config["chat_template"] = REFUSE_LATE + config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, help="a checkout to compare against")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results/session_prefix.json")
    args = parser.parse_args()
    trees = [CURRENT] + ([Tree(args.baseline_tree, "baseline")] if args.baseline_tree else [])
    results: dict[str, dict[str, list[dict[str, int]]]] = {}
    with tempfile.TemporaryDirectory(prefix="zerohop-session-prefix-") as tmp:
        for refuse_late in (False, True):
            template = "refuse-late" if refuse_late else "own"
            folder = model_folder(Path(tmp), refuse_late)
            for tree in trees:
                log = args.out.parent / f"session_prefix-{template}-{tree.name}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                flags = ["--no-gateway", "--num-threads", "2"]
                with ZerohopServer(folder, flags, log, tree, XDG_DATA_HOME=tmp) as server:
                    results.setdefault(template, {})[tree.name] = run_session(
                        server.url, args.turns
                    )
            report(template, results[template])
    write_json(args.out, {"turns": args.turns, "results": results})
    print(f"wrote {args.out}")


def report(template: str, by_tree: dict[str, list[dict[str, int]]]) -> None:
    print(f"\ntemplate: {template} (cached / prompt tokens per turn)")
    names = list(by_tree)
    rows = []
    for turn, usages in enumerate(zip(*by_tree.values(), strict=True), start=1):
        rows.append([turn, *(f"{u['cached']}/{u['prompt']} {fraction(u):.0%}" for u in usages)])
    print_table(["turn", *names], rows)


def fraction(usage: dict[str, int]) -> float:
    return usage["cached"] / usage["prompt"] if usage["prompt"] else 0.0


if __name__ == "__main__":
    main()
