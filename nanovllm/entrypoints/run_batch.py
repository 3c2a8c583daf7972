"""`nanovllm run-batch -i INPUT.jsonl -o OUTPUT.jsonl`: an OpenAI batch file through the server's code.

Every line goes through the same parsing, validation and handlers as a request to
`nanovllm serve` (entrypoints/openai/: `parse_chat_request`, `OpenAIServingChat`, ...)
on one `AsyncLLM`, so a body the server would refuse becomes an error line with the
server's status and message, and an answer is the server's non-streaming response.
All pending lines join one continuous batch (a bounded number in flight); each
output line is written and flushed as its request finishes, in finishing order.
The file format and resume rules are in entrypoints/batch_file.py.

With `--data-parallel-size N` (or `--ray-address`), the lines go to N engine replicas
on a Ray cluster instead (entrypoints/ray/batch.py; `pip install 'nanovllm[ray]'`).

An engine fault stops the job (the lines it was running are not written, so a
rerun does them); a bad line never does.
"""
import argparse
import asyncio
import json
import logging
import sys
import time

from nanovllm.entrypoints import batch_file
from nanovllm.entrypoints.batch_file import BatchLineError, BatchRequest, OutputWriter
from nanovllm.entrypoints.ray_args import add_data_parallel_args, uses_ray

logger = logging.getLogger("nanovllm")

# Requests in flight per engine, as a multiple of its max_num_seqs: enough that the
# scheduler always has the next ones waiting, few enough not to tokenize a whole file at once.
IN_FLIGHT_PER_SEQ_SLOT = 2
ENGINE_DEAD_STATUS = 503


class EngineFault(RuntimeError):
    """The engine died while answering a line: the job must stop (a rerun redoes that line)."""


# ---- one line -> one output line ----------------------------------------------------------

class BatchRunner:
    """Answers batch lines with the server's handlers on one `AsyncLLM`.

    Args:
        async_llm: the engine (its loop thread running).
        served_model_names: the names a body's `model` may use (the server's --served-model-name).
        chat_template: the server's chat template (None: chat lines get the server's 400).
    """

    def __init__(self, async_llm, served_model_names: list[str], chat_template=None):
        from nanovllm.entrypoints.openai.metrics import ServerMetrics
        from nanovllm.entrypoints.openai.serving_chat import OpenAIServingChat
        from nanovllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
        self.metrics = ServerMetrics()
        self.completion = OpenAIServingCompletion(async_llm, served_model_names, self.metrics)
        self.chat = OpenAIServingChat(async_llm, served_model_names, self.metrics, chat_template)

    async def answer(self, line_no: int, text: str) -> dict:
        """The output line for one input line. Raises EngineFault if the engine died."""
        from nanovllm.entrypoints.openai.errors import APIError
        try:
            request = batch_file.parse_batch_line(line_no, text)
        except BatchLineError as e:
            return batch_file.error_line(line_no, e.custom_id, 400, str(e), e.param, batch_file.INVALID_LINE)
        try:
            return batch_file.success_line(request, await self._respond(request))
        except APIError as e:
            if e.status == ENGINE_DEAD_STATUS:
                raise EngineFault(f"line {line_no}: {e.message}") from None
            return batch_file.error_line(line_no, request.custom_id, e.status, e.message, e.param, e.code)
        except Exception as e:  # noqa: BLE001 -- the server answers these with a 500 and goes on; so do we
            logger.exception("unexpected error on line %d", line_no)
            return batch_file.error_line(line_no, request.custom_id, 500,
                                         f"internal server error: {type(e).__name__}: {e}")

    async def _respond(self, request: BatchRequest) -> dict:
        from nanovllm.entrypoints.openai.errors import bad_request
        from nanovllm.entrypoints.openai.protocol import parse_chat_request, parse_completion_request
        if request.url == batch_file.CHAT_URL:
            parsed = parse_chat_request(request.body)
            handler = self.chat.create_chat_completion
        else:
            parsed = parse_completion_request(request.body)
            handler = self.completion.create_completion
        if parsed.stream:
            raise bad_request("'stream' is not supported in a batch file: each answer is one response", "stream")
        return await handler(parsed)


async def answer_all(runner: BatchRunner, lines: list[tuple[int, str]], max_in_flight: int, on_done) -> None:
    """Answer `lines`, at most `max_in_flight` at a time, calling `on_done(output_line)` as each
    finishes. An EngineFault cancels the rest and is raised."""
    queue = iter(lines)

    async def worker() -> None:
        for line_no, text in queue:
            on_done(await runner.answer(line_no, text))

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(max_in_flight, len(lines))))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- progress -----------------------------------------------------------------------------------

class BatchProgress:
    """A progress bar on stderr: requests done, requests/s and generated tokens/s."""

    def __init__(self, total: int, already_done: int, enabled: bool = True):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=total, desc="run-batch", unit="req", dynamic_ncols=True, disable=not enabled,
                        file=sys.stderr)
        self.start = time.monotonic()
        self.num_done = 0
        self.num_tokens = 0
        self.num_errors = 0
        self.already_done = already_done

    def update(self, line: dict) -> None:
        self.num_done += 1
        self.num_tokens += batch_file.completion_tokens(line)
        self.num_errors += line.get("error") is not None
        self.bar.update(1)
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.num_tokens / elapsed:.1f} tok/s, {self.num_errors} errors", refresh=False)

    def close(self) -> dict:
        """Close the bar; returns the run's summary (also printed by the CLI)."""
        self.bar.close()
        elapsed = time.monotonic() - self.start
        done = self.num_done
        return {"requests": done, "errors": self.num_errors, "skipped": self.already_done,
                "generated_tokens": self.num_tokens, "seconds": round(elapsed, 3),
                "requests_per_s": round(done / elapsed, 3) if elapsed > 0 else 0.0,
                "tokens_per_s": round(self.num_tokens / elapsed, 3) if elapsed > 0 else 0.0}


# ---- the job ----------------------------------------------------------------------------------

def plan(input_path: str, output_path: str) -> tuple[list[tuple[int, str]], OutputWriter, int]:
    """(pending lines, a writer appending to the output, number already answered)."""
    lines = batch_file.read_input(input_path)
    done = batch_file.recover_output(output_path)
    pending = batch_file.pending_lines(lines, done)
    return pending, OutputWriter(output_path, done), len(lines) - len(pending)


def run_local(async_llm, served_model_names: list[str], chat_template, input_path: str, output_path: str,
              progress: bool = True) -> dict:
    """Run a batch file on one engine. Returns the summary. Raises EngineFault if the engine dies."""
    pending, writer, skipped = plan(input_path, output_path)
    runner = BatchRunner(async_llm, served_model_names, chat_template)
    bar = BatchProgress(len(pending), skipped, progress)

    def on_done(line: dict) -> None:
        if writer.write(line):
            bar.update(line)

    max_in_flight = IN_FLIGHT_PER_SEQ_SLOT * async_llm.config.max_num_seqs
    try:
        asyncio.run(answer_all(runner, pending, max_in_flight, on_done))
    finally:
        writer.close()
        summary = bar.close()
    return summary


# ---- command line --------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from nanovllm.entrypoints.cli import add_engine_args
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSON lines), a local path")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where answers go (JSON lines); an existing file is resumed: its custom_ids are skipped")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) a body's 'model' may name (default: the --model argument)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (default: the tokenizer's template)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=None, help="the engine's random seed (a body's 'seed' wins)")
    add_data_parallel_args(parser.add_argument_group("data parallelism (Ray)"))
    add_engine_args(parser.add_argument_group("engine"))
    return parser


def main(argv: list[str]) -> None:
    """`nanovllm run-batch ...`; prints the summary as one JSON line on stdout."""
    args = add_cli_args(argparse.ArgumentParser(
        prog="nanovllm run-batch", description="Answer an OpenAI batch file (JSON lines) with nano-vLLM.")
    ).parse_args(argv)
    if uses_ray(args):
        from nanovllm.entrypoints.ray.batch import run_on_ray
        summary = run_on_ray(args)
    else:
        summary = _run_local_from_args(args)
    print(json.dumps(summary), flush=True)


def _run_local_from_args(args: argparse.Namespace) -> dict:
    from nanovllm.engine.async_llm import AsyncLLM
    from nanovllm.entrypoints.cli import engine_kwargs
    from nanovllm.entrypoints.openai.api_server import default_model_name
    from nanovllm.entrypoints.openai.chat_template import load_chat_template
    batch_file.read_input(args.input_file)             # a missing or bad file fails before the slow model load
    if args.chat_template is not None:
        load_chat_template(args.chat_template, None)
    async_llm = AsyncLLM(args.model, log_stats_interval=0, **engine_kwargs(args))
    try:
        chat_template = load_chat_template(args.chat_template, async_llm.tokenizer)
        names = args.served_model_name or [default_model_name(args.model, async_llm)]
        return run_local(async_llm, names, chat_template, args.input_file, args.output_file,
                         progress=not args.no_progress)
    finally:
        async_llm.shutdown()
