"""Data-parallel replicas on Ray: batch jobs (Ray Data) and serving (Ray Serve).

    nanovllm run-batch -i IN.jsonl -o OUT.jsonl --data-parallel-size 4 [--ray-address ADDR]
    nanovllm serve MODEL --data-parallel-size 4 [--ray-address ADDR]

Each replica is one Ray actor holding one engine (one `AsyncLLM`, with its own
tensor-parallel ranks and the GPUs Ray gave it); Ray places, restarts and retries
the actors, nothing here does cluster membership or scheduling. This package sits
in entrypoints/ because it is the server's and run-batch's code spread over
replicas: the engine itself does not know it runs on Ray.

    replica.py   what one replica asks Ray for (CPUs, GPUs, threads) and how it starts
    batch.py     the Ray Data processor and `run-batch --data-parallel-size`
    serve.py     the Ray Serve application: OpenAI ingress + engine replicas
    router.py    prefix-aware request routing (a custom Serve request router)
    metrics.py   every replica's /metrics, merged under a `replica` label

Ray is an optional extra (`pip install 'nanovllm[ray]'`), imported only here.
"""


def require_ray():
    """The `ray` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("data parallelism runs on Ray: pip install 'nanovllm[ray]'") from e
    return ray


def init_ray(address: str | None) -> None:
    """Join the cluster at `address`, or start a local one (None); no-op when already connected."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True)
