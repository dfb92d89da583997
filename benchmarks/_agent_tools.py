"""The 22 tools of benchmarks/agents.py's session, with realistic JSON schemas (nested
objects and arrays, enums, bounds), written for this benchmark: Read, Write, Edit, MultiEdit,
Bash, Grep, Glob, TodoWrite, Task, AskUserQuestion, ..."""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_STR = {"type": "string"}
_PATH = {"type": "string", "description": "Absolute path of the file (not a relative one)."}

TOOLS: list[dict[str, Any]] = [
    {
        "name": "Read",
        "description": (
            "Reads a file from the local filesystem and returns its lines, numbered from 1. "
            "By default it reads up to 2000 lines from the start of the file; pass offset and "
            "limit to read a window of a long file. Lines longer than 2000 characters are "
            "cut. Images and PDF files are returned as content blocks. Reading a file that "
            "does not exist is an error, not an empty result. Prefer reading several files "
            "in one turn when you already know you need them."
        ),
        "input_schema": _obj(
            {
                "file_path": _PATH,
                "offset": {"type": "integer", "minimum": 1, "description": "First line."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 2000},
            },
            ["file_path"],
        ),
    },
    {
        "name": "Write",
        "description": (
            "Writes a file to the local filesystem, replacing any file already at the path. "
            "Read an existing file first: the tool refuses to overwrite a file that was not "
            "read in this session. Prefer editing existing files to writing new ones, and "
            "never create documentation files unless the user asks for them."
        ),
        "input_schema": _obj({"file_path": _PATH, "content": _STR}, ["file_path", "content"]),
    },
    {
        "name": "Edit",
        "description": (
            "Replaces exact text in a file. old_string must occur in the file exactly once, "
            "with its indentation as the file has it (not as the Read tool's line-number "
            "prefix shows it), unless replace_all is set, which replaces every occurrence "
            "(useful to rename a variable). The edit fails if old_string is not found or is "
            "not unique; give more surrounding lines to make it unique."
        ),
        "input_schema": _obj(
            {
                "file_path": _PATH,
                "old_string": _STR,
                "new_string": _STR,
                "replace_all": {"type": "boolean", "default": False},
            },
            ["file_path", "old_string", "new_string"],
        ),
    },
    {
        "name": "MultiEdit",
        "description": (
            "Several Edit operations on one file, applied in order, all or none: each edit "
            "sees the file as the previous one left it. Use it rather than many Edit calls "
            "when changing several places of the same file."
        ),
        "input_schema": _obj(
            {
                "file_path": _PATH,
                "edits": {
                    "type": "array",
                    "minItems": 1,
                    "items": _obj(
                        {
                            "old_string": _STR,
                            "new_string": _STR,
                            "replace_all": {"type": "boolean"},
                        },
                        ["old_string", "new_string"],
                    ),
                },
            },
            ["file_path", "edits"],
        ),
    },
    {
        "name": "Bash",
        "description": (
            "Runs a command in a persistent shell session, with an optional timeout. Quote "
            "paths that contain spaces. Do not use it to read, search or edit files: the "
            "Read, Grep, Glob and Edit tools do that better. Commands that run long can be "
            "started in the background and read later with BashOutput. Never run "
            "interactive commands (git rebase -i, editors), never push or force-push unless "
            "the user asked for it, and explain any command that changes the system."
        ),
        "input_schema": _obj(
            {
                "command": _STR,
                "description": {
                    "type": "string",
                    "description": "What the command does, in five to ten words.",
                },
                "timeout": {"type": "integer", "minimum": 1000, "maximum": 600000},
                "run_in_background": {"type": "boolean"},
            },
            ["command"],
        ),
    },
    {
        "name": "BashOutput",
        "description": (
            "Returns the new output of a background shell since the last call, and whether "
            "it is still running. An optional regular expression keeps only matching lines."
        ),
        "input_schema": _obj({"bash_id": _STR, "filter": _STR}, ["bash_id"]),
    },
    {
        "name": "KillShell",
        "description": "Stops a background shell by its id.",
        "input_schema": _obj({"shell_id": _STR}, ["shell_id"]),
    },
    {
        "name": "Grep",
        "description": (
            "Searches file contents with ripgrep's regular expressions. Filter files with "
            "glob or type; output_mode chooses matching lines with context, file paths only "
            "(the default), or counts per file. Use it instead of running grep or rg "
            "through Bash. Braces and other regex metacharacters need escaping."
        ),
        "input_schema": _obj(
            {
                "pattern": _STR,
                "path": _STR,
                "glob": _STR,
                "type": {"type": "string", "enum": ["py", "js", "ts", "rust", "go", "md"]},
                "output_mode": {
                    "type": "string",
                    "enum": ["content", "files_with_matches", "count"],
                },
                "-i": {"type": "boolean"},
                "-n": {"type": "boolean"},
                "-A": {"type": "integer", "minimum": 0},
                "-B": {"type": "integer", "minimum": 0},
                "multiline": {"type": "boolean"},
                "head_limit": {"type": "integer", "minimum": 1},
            },
            ["pattern"],
        ),
    },
    {
        "name": "Glob",
        "description": (
            "Finds files by name pattern (such as **/*.py or src/**/test_*.ts), newest "
            "first. Works on any size of repository; use it to find files by name, and "
            "Grep to find them by content."
        ),
        "input_schema": _obj({"pattern": _STR, "path": _STR}, ["pattern"]),
    },
    {
        "name": "LS",
        "description": "Lists a directory's entries; ignore takes glob patterns to leave out.",
        "input_schema": _obj({"path": _PATH, "ignore": {"type": "array", "items": _STR}}, ["path"]),
    },
    {
        "name": "WebFetch",
        "description": (
            "Fetches a URL, converts the page to markdown and answers the prompt about it "
            "with a small, fast model. HTTP is upgraded to HTTPS. A redirect to another host "
            "is reported, not followed: fetch the new URL yourself."
        ),
        "input_schema": _obj(
            {"url": {"type": "string", "format": "uri"}, "prompt": _STR}, ["url", "prompt"]
        ),
    },
    {
        "name": "WebSearch",
        "description": (
            "Searches the web and returns result blocks with titles and links. Domains can "
            "be allowed or blocked; give the current year in queries about recent events."
        ),
        "input_schema": _obj(
            {
                "query": {"type": "string", "minLength": 2},
                "allowed_domains": {"type": "array", "items": _STR},
                "blocked_domains": {"type": "array", "items": _STR},
            },
            ["query"],
        ),
    },
    {
        "name": "TodoWrite",
        "description": (
            "Creates and updates the task list of this session. Use it for work of three "
            "steps or more, and when the user gives several tasks at once. Exactly one task "
            "is in_progress at a time; mark a task completed as soon as it is done, never "
            "batch completions, and never mark a task completed while its tests fail."
        ),
        "input_schema": _obj(
            {
                "todos": {
                    "type": "array",
                    "items": _obj(
                        {
                            "content": {"type": "string", "minLength": 1},
                            "status": {
                                "type": "string",
                                "enum": ["pending", "in_progress", "completed"],
                            },
                            "priority": {"type": "string", "enum": ["high", "medium", "low"]},
                            "id": _STR,
                        },
                        ["content", "status", "id"],
                    ),
                }
            },
            ["todos"],
        ),
    },
    {
        "name": "Task",
        "description": (
            "Starts a sub-agent for a complex, multi-step task and returns its final report. "
            "Each sub-agent type has its own tools. Give it a detailed, self-contained "
            "prompt and say whether it should write code or only research; its result is "
            "not shown to the user, so summarize it."
        ),
        "input_schema": _obj(
            {
                "description": _STR,
                "prompt": _STR,
                "subagent_type": {
                    "type": "string",
                    "enum": ["general-purpose", "explore", "plan", "code-reviewer"],
                },
            },
            ["description", "prompt", "subagent_type"],
        ),
    },
    {
        "name": "NotebookRead",
        "description": "Reads a Jupyter notebook's cells with their outputs.",
        "input_schema": _obj({"notebook_path": _PATH, "cell_id": _STR}, ["notebook_path"]),
    },
    {
        "name": "NotebookEdit",
        "description": (
            "Replaces, inserts or deletes one cell of a Jupyter notebook (.ipynb), by its "
            "id; an inserted cell goes after the given one, or first without an id."
        ),
        "input_schema": _obj(
            {
                "notebook_path": _PATH,
                "cell_id": _STR,
                "new_source": _STR,
                "cell_type": {"type": "string", "enum": ["code", "markdown"]},
                "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]},
            },
            ["notebook_path", "new_source"],
        ),
    },
    {
        "name": "ExitPlanMode",
        "description": (
            "Ends plan mode once the plan for an implementation task is ready for the "
            "user's approval. Not for research tasks."
        ),
        "input_schema": _obj({"plan": {"type": "string", "minLength": 1}}, ["plan"]),
    },
    {
        "name": "AskUserQuestion",
        "description": (
            "Asks the user one to four multiple-choice questions when a decision is theirs "
            "to make; each question has two to four options with a short description."
        ),
        "input_schema": _obj(
            {
                "questions": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "question": _STR,
                            "header": {"type": "string", "maxLength": 12},
                            "multiSelect": {"type": "boolean"},
                            "options": {
                                "type": "array",
                                "minItems": 2,
                                "maxItems": 4,
                                "items": _obj(
                                    {"label": _STR, "description": _STR},
                                    ["label", "description"],
                                ),
                            },
                        },
                        ["question", "header", "options", "multiSelect"],
                    ),
                }
            },
            ["questions"],
        ),
    },
    {
        "name": "SlashCommand",
        "description": "Runs one of the project's custom slash commands with its arguments.",
        "input_schema": _obj({"command": {"type": "string", "pattern": "^/"}}, ["command"]),
    },
    {
        "name": "Skill",
        "description": "Loads a named skill's instructions into the conversation.",
        "input_schema": _obj({"skill": _STR}, ["skill"]),
    },
    {
        "name": "ListMcpResources",
        "description": "Lists the resources that the connected MCP servers offer.",
        "input_schema": _obj({"server": _STR}, []),
    },
    {
        "name": "ReadMcpResource",
        "description": "Reads one resource from an MCP server by its URI.",
        "input_schema": _obj({"server": _STR, "uri": _STR}, ["server", "uri"]),
    },
]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
