"""Batch jobs on Ray Data: `OpenAIBatchProcessor` and `run-batch --data-parallel-size N`.

The processor is a callable class for `Dataset.map_batches`: each actor of the pool
is one replica holding one engine, and answers its rows with the same `BatchRunner`
as the one-engine `run-batch` (entrypoints/run_batch.py), so the answers and error
lines are the same:

    import ray
    from nanovllm.entrypoints.ray.batch import OpenAIBatchProcessor, processor_options
    from nanovllm.entrypoints.ray.replica import ReplicaSpec

    spec = ReplicaSpec(model="/models/qwen3", num_replicas=2, num_cpus=0.5)
    ds = ray.data.from_items([{"line": text} for text in open("batch.jsonl")])
    out = ds.map_batches(OpenAIBatchProcessor, **processor_options(spec, batch_size=16))
    out.write_json("answers/")     # rows: line_no, custom_id, output (the output line's JSON)

Rows hold `line` (a batch line's JSON text) and optionally `line_no`, or the
columns `custom_id`, `method`, `url`, `body` of `ray.data.read_json(batch file)`.
The processor is async, so several batches share one replica's continuous batch.

Faults: Ray restarts a dead replica actor and retries its unfinished batches (Ray
Data's actor pools default to unlimited max_restarts and max_task_retries). `run_on_ray` writes each
custom_id once whatever arrives twice, so every line is answered exactly once.
"""
import asyncio
import json
import math

from nanovllm.entrypoints.ray import init_ray, require_ray
from nanovllm.entrypoints.ray.replica import ReplicaSpec, start_engine

# Batches (Ray Data tasks) one replica runs at once: together they are its continuous batch.
TASKS_PER_REPLICA = 4
MAX_ROWS_PER_BATCH = 64


class OpenAIBatchProcessor:
    """A Ray Data callable class: one engine per actor; batch lines in, output lines out."""

    def __init__(self, spec: ReplicaSpec):
        from nanovllm.entrypoints.run_batch import BatchRunner
        self.replica = start_engine(spec)
        self.runner = BatchRunner(self.replica.async_llm, self.replica.served_model_names,
                                  self.replica.chat_template)

    async def __call__(self, batch: dict) -> dict:
        """Answer one batch. Raises EngineFault if the engine died (the job stops; a rerun resumes)."""
        rows = _rows(batch)
        outputs = await asyncio.gather(*(self.runner.answer(n, text) for n, text in rows))
        return {"line_no": [n for n, _ in rows], "custom_id": [o["custom_id"] for o in outputs],
                "output": [json.dumps(o, ensure_ascii=False) for o in outputs]}


def _rows(batch: dict) -> list[tuple[int, str]]:
    """(line number, line text) of each row: a `line` column, or read_json's four columns."""
    if "line" in batch:
        lines = [str(t) for t in batch["line"]]
    else:
        keys = [k for k in ("custom_id", "method", "url", "body") if k in batch]
        count = len(batch[keys[0]]) if keys else 0
        lines = [json.dumps({k: _plain(batch[k][i]) for k in keys}) for i in range(count)]
    numbers = batch.get("line_no")
    return [(int(numbers[i]) if numbers is not None else i + 1, text) for i, text in enumerate(lines)]


def _plain(value):
    """A column value as plain JSON-able Python (numpy arrays and scalars from Arrow)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def processor_options(spec: ReplicaSpec, batch_size: int) -> dict:
    """`map_batches` keyword arguments that run `OpenAIBatchProcessor` as `spec`'s replica pool
    (`spec.num_replicas` actors, each running TASKS_PER_REPLICA batches at once)."""
    from ray.data import ActorPoolStrategy
    pool = ActorPoolStrategy(size=spec.num_replicas, max_tasks_in_flight_per_actor=TASKS_PER_REPLICA,
                             max_concurrent_calls_per_actor=TASKS_PER_REPLICA)
    return {"fn_constructor_kwargs": {"spec": spec}, "compute": pool, "batch_size": batch_size,
            **spec.actor_options()}


def run_on_ray(args) -> dict:
    """`run-batch` with `--data-parallel-size N` replicas on Ray; returns the summary."""
    from nanovllm.entrypoints.run_batch import BatchProgress, plan
    ray = require_ray()
    pending, writer, skipped = plan(args.input_file, args.output_file)
    bar = BatchProgress(len(pending), skipped, not args.no_progress)
    try:
        if pending:
            init_ray(args.ray_address)
            spec = ReplicaSpec.from_args(args, ray.cluster_resources())
            for row in answered_rows(spec, pending):
                line = json.loads(row["output"])
                if writer.write(line):
                    bar.update(line)
    finally:
        writer.close()
        summary = bar.close()
    return summary


def answered_rows(spec: ReplicaSpec, lines: list[tuple[int, str]]):
    """The processor's output rows for `lines`, as each batch finishes (any order)."""
    import ray.data
    ray.data.DataContext.get_current().enable_progress_bars = False   # run-batch draws its own
    batch_size = max(1, min(MAX_ROWS_PER_BATCH, math.ceil(len(lines) / (spec.num_replicas * TASKS_PER_REPLICA))))
    ds = ray.data.from_items([{"line_no": n, "line": text} for n, text in lines],
                             override_num_blocks=math.ceil(len(lines) / batch_size))
    return ds.map_batches(OpenAIBatchProcessor, **processor_options(spec, batch_size)).iter_rows()
