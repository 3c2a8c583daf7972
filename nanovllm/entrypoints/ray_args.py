"""Command-line flags for data-parallel replicas on Ray, shared by `run-batch` and `serve`.

Kept apart from entrypoints/ray/ so `nanovllm --help` and the one-engine paths
never import Ray: only `uses_ray(args)` being True leads there.
"""
import argparse


def add_data_parallel_args(group) -> None:
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas, each a Ray actor with its own tensor-parallel group; above 1 "
                            "(or with --ray-address) the job runs on Ray (pip install 'nanovllm[ray]')")
    group.add_argument("--ray-address", default=None,
                       help="the Ray cluster to join (e.g. ray://head:10001 or auto); default: start a local one")
    group.add_argument("--cpus-per-replica", type=float, default=None,
                       help="CPUs each replica asks Ray for (fractions allowed); torch threads per replica follow "
                            "it (at least 1). Default: 1, or an equal share of the cluster's CPUs less one when "
                            "that is smaller")


def uses_ray(args: argparse.Namespace) -> bool:
    """True when the command should run its replicas on Ray. Raises ValueError for a bad size."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.cpus_per_replica is not None and not args.cpus_per_replica > 0:
        raise ValueError(f"--cpus-per-replica must be > 0, got {args.cpus_per_replica}")
    return args.data_parallel_size > 1 or args.ray_address is not None
