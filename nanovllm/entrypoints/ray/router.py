"""Prefix-aware routing: send a request to the replica most likely to hold its prompt's prefix.

The ingress tokenizes each prompt and hashes its first blocks with the block
manager's own chain hash (`prefix_hashes`); the hashes travel with the call as the
`prefix_hashes` keyword. `PrefixAwareRequestRouter`, a custom Ray Serve request
router running in the caller's process, remembers which replica each hash was sent
to (an LRU map): a request goes to the replica that got its longest known prefix,
unless that replica's queue is `imbalance_threshold` requests longer than the
shortest; otherwise (or with no known prefix) to the least loaded replica, ties
broken towards the replica owning the fewest prefixes, so distinct prefixes spread
out. Serve then probes the chosen rank's queue lengths and falls back to the next
rank when a replica is full or gone.
"""
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from nanovllm.engine.block_manager import NO_HASH, hash_block

# Blocks of a prompt the ingress hashes: enough to tell system prompts and few-shot
# prefixes apart, few enough that hashing costs nothing next to tokenizing.
DEFAULT_ROUTING_BLOCKS = 8
DEFAULT_MAX_TRACKED_PREFIXES = 100_000
DEFAULT_IMBALANCE_THRESHOLD = 8


def prefix_hashes(token_ids: list[int], block_size: int, num_blocks: int = DEFAULT_ROUTING_BLOCKS) -> list[int]:
    """Chain hashes of the first `num_blocks` full blocks of `token_ids` (as the prefix cache keys them)."""
    hashes, prev = [], NO_HASH
    for start in range(0, min(len(token_ids) // block_size, num_blocks) * block_size, block_size):
        prev = hash_block(token_ids[start:start + block_size], prev)
        hashes.append(prev)
    return hashes


class PrefixAwareRequestRouter(RequestRouter):
    """Routes by prompt prefix, falling back to the least loaded replica; see the module docstring."""

    def initialize_state(self, max_tracked_prefixes: int = DEFAULT_MAX_TRACKED_PREFIXES,
                         imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD):
        if max_tracked_prefixes < 1 or imbalance_threshold < 0:
            raise ValueError(f"max_tracked_prefixes must be >= 1 and imbalance_threshold >= 0, got "
                             f"{max_tracked_prefixes} and {imbalance_threshold}")
        self.max_tracked_prefixes = max_tracked_prefixes
        self.imbalance_threshold = imbalance_threshold
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()   # prefix hash -> replica it went to
        self.num_owned: dict[ReplicaID, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas, most preferred first: the prefix owner (if balanced), then the rest."""
        if not candidate_replicas:
            return []
        hashes = list((pending_request.kwargs.get("prefix_hashes") if pending_request else None) or [])
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen = self._prefix_owner(hashes, by_id) or self._least_loaded(candidate_replicas)
        self._remember(hashes, chosen.replica_id)
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def _prefix_owner(self, hashes: list[int], by_id: dict) -> RunningReplica | None:
        for h in reversed(hashes):   # the longest known prefix first
            owner = by_id.get(self.owners.get(h))
            if owner is not None:
                return owner if self._balanced(owner, by_id.values()) else None
        return None

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def _balanced(self, replica: RunningReplica, candidates) -> bool:
        shortest = min(self._queue_len(r) for r in candidates)
        return self._queue_len(replica) - shortest <= self.imbalance_threshold

    def _least_loaded(self, candidates: list[RunningReplica]) -> RunningReplica:
        return min(candidates, key=lambda r: (self._queue_len(r), self.num_owned.get(r.replica_id, 0)))

    def _remember(self, hashes: list[int], replica_id: ReplicaID) -> None:
        for h in hashes:
            previous = self.owners.pop(h, None)
            if previous is not None:
                self.num_owned[previous] -= 1
            self.owners[h] = replica_id
            self.num_owned[replica_id] = self.num_owned.get(replica_id, 0) + 1
        while len(self.owners) > self.max_tracked_prefixes:
            _, evicted = self.owners.popitem(last=False)
            self.num_owned[evicted] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        for h in [h for h, owner in self.owners.items() if owner == replica_id]:
            del self.owners[h]
        self.num_owned.pop(replica_id, None)
