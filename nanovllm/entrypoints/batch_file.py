"""OpenAI batch files, as `vllm run-batch` reads and writes them: lines in, lines out, resume.

Input, one JSON object a line (blank lines are skipped):

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`url` is "/v1/chat/completions" or "/v1/completions"; `body` is what the server's
route would take. Output, one line per input line, in the order requests finish:

    {"id": "batch_req_...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}, "error": null}

A request the server would refuse, or a line that is not a batch request at all,
is an error line: `response` holds the status and the OpenAI error body the server
would answer, `error` holds `{"code", "message", "param", "line"}` (the message
starts with the line number). The job goes on.

Resume: the output file is appended to. Before a run, the lines already written
are read back; their custom_ids (for error lines without a custom_id, their line
numbers) are skipped, and a last line cut short by a killed run (no newline, or
not JSON) is truncated away and redone, so an interrupted job loses nothing and
repeats nothing. This module is pure file handling: no engine, no event loop.
"""
import json
import os
from dataclasses import dataclass, field

from nanovllm.utils.random_ids import random_hex

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
BATCH_URLS = (CHAT_URL, COMPLETIONS_URL)
BATCH_LINE_KEYS = frozenset(("custom_id", "method", "url", "body"))
# Error codes of lines that never reached a handler (OpenAI's batch validation uses such names).
INVALID_LINE = "invalid_batch_line"


@dataclass(frozen=True)
class BatchRequest:
    """One valid input line: where it goes and the body for that route."""
    line_no: int          # 1-based, as editors count
    custom_id: str
    url: str
    body: dict


class BatchLineError(ValueError):
    """An input line that is not a batch request; `custom_id` is kept when the line had one."""

    def __init__(self, line_no: int, message: str, custom_id: str | None = None, param: str | None = None):
        super().__init__(f"line {line_no}: {message}")
        self.line_no = line_no
        self.custom_id = custom_id
        self.param = param


def parse_batch_line(line_no: int, text: str) -> BatchRequest:
    """The request on one input line. Raises BatchLineError naming what is wrong."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BatchLineError(line_no, f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise BatchLineError(line_no, f"a batch line must be a JSON object, got {type(value).__name__}")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError(line_no, f"'custom_id' must be a non-empty string, got {custom_id!r:.80}",
                             param="custom_id")
    unknown = sorted(set(value) - BATCH_LINE_KEYS)
    if unknown:
        raise BatchLineError(line_no, f"unknown field {unknown[0]!r} (a batch line has {sorted(BATCH_LINE_KEYS)})",
                             custom_id, unknown[0])
    if value.get("method") != "POST":
        raise BatchLineError(line_no, f"'method' must be \"POST\", got {value.get('method')!r:.80}", custom_id,
                             "method")
    if value.get("url") not in BATCH_URLS:
        raise BatchLineError(line_no, f"'url' must be one of {', '.join(BATCH_URLS)}; got {value.get('url')!r:.80}",
                             custom_id, "url")
    if not isinstance(value.get("body"), dict):
        raise BatchLineError(line_no, f"'body' must be a JSON object, got {value.get('body')!r:.80}", custom_id,
                             "body")
    return BatchRequest(line_no, custom_id, value["url"], value["body"])


def read_input(path: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line. Raises ValueError if two lines share a custom_id
    (OpenAI refuses such a file: an answer could not be told apart from the other's)."""
    lines, seen = [], {}
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            lines.append((line_no, text))
            custom_id = _custom_id_of(text)
            if custom_id is not None and custom_id in seen:
                raise ValueError(f"{path}: custom_id {custom_id!r} appears on lines {seen[custom_id]} and {line_no}; "
                                 "custom_ids must be unique")
            if custom_id is not None:
                seen[custom_id] = line_no
    return lines


def _custom_id_of(text: str) -> str | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


# ---- output lines ---------------------------------------------------------------------

def success_line(request: BatchRequest, body: dict) -> dict:
    return {"id": new_batch_id(), "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": body.get("id", new_batch_id()), "body": body},
            "error": None}


def error_line(line_no: int, custom_id: str | None, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """An error line: the server's error body in `response`, and a batch `error` naming the line."""
    from nanovllm.entrypoints.openai.errors import error_body
    message = message if message.startswith(f"line {line_no}:") else f"line {line_no}: {message}"
    body = error_body(status, message, param, code)
    return {"id": new_batch_id(), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": new_batch_id(), "body": body},
            "error": {"code": str(body["error"]["code"]), "message": message, "param": param, "line": line_no}}


def new_batch_id() -> str:
    return f"batch_req_{random_hex()}"


def completion_tokens(line: dict) -> int:
    """Generated tokens of an output line (0 for an error line)."""
    response = line.get("response") or {}
    usage = (response.get("body") or {}).get("usage") or {}
    return int(usage.get("completion_tokens", 0))


# ---- resume ---------------------------------------------------------------------------

@dataclass
class DoneSet:
    """What an output file already answers: custom_ids, and line numbers of lines that had none."""
    custom_ids: set[str] = field(default_factory=set)
    line_nos: set[int] = field(default_factory=set)

    def add(self, line: dict) -> None:
        if line.get("custom_id") is not None:
            self.custom_ids.add(line["custom_id"])
        elif isinstance(line.get("error"), dict) and isinstance(line["error"].get("line"), int):
            self.line_nos.add(line["error"]["line"])

    def __contains__(self, key: tuple[int, str | None]) -> bool:
        line_no, custom_id = key
        return custom_id in self.custom_ids if custom_id is not None else line_no in self.line_nos

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.line_nos)


def recover_output(path: str) -> DoneSet:
    """Read an existing output file; truncate a cut-short last line. Raises ValueError for a
    damaged line before the last (not something a killed run leaves)."""
    done = DoneSet()
    if not os.path.exists(path):
        return done
    with open(path, "rb+") as f:
        data = f.read()
        good_end, pos = 0, 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            line = _output_line(data[pos:end]) if end >= 0 else None
            if line is None:
                if end >= 0 and data.find(b"\n", end + 1) >= 0:
                    line_no = data.count(b"\n", 0, pos) + 1
                    raise ValueError(f"{path}: output line {line_no} is not a batch output line; "
                                     "is this the output of another job?")
                break   # the last line, cut short by a killed run
            done.add(line)
            good_end = pos = end + 1
        if good_end < len(data):
            f.truncate(good_end)
    return done


def _output_line(raw: bytes) -> dict | None:
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return line if isinstance(line, dict) and "custom_id" in line and "response" in line else None


def pending_lines(lines: list[tuple[int, str]], done: DoneSet) -> list[tuple[int, str]]:
    """The input lines the output does not answer yet."""
    return [(n, text) for n, text in lines if (n, _custom_id_of(text)) not in done]


class OutputWriter:
    """Appends output lines, flushing each, and writes each custom_id (or error line number) once."""

    def __init__(self, path: str, done: DoneSet):
        self.file = open(path, "a", encoding="utf-8", errors="surrogateescape")
        self.done = done

    def write(self, line: dict) -> bool:
        """Write `line` unless its request is already answered (a retried replica's repeat); True if written."""
        key = (line["error"]["line"] if line.get("error") else 0, line.get("custom_id"))
        if key in self.done:
            return False
        self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()
        self.done.add(line)
        return True

    def close(self) -> None:
        self.file.close()
