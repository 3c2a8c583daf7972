"""Tensor parallelism on CPU: 2 ranks over gloo, against TP=1 and Hugging Face.

- Each rank's weights are exactly its shard of the checkpoint (safetensors slices
  and whole tensors, as GGUF gives them), with KV heads replicated for MQA and the
  vocabulary padded when it does not split evenly.
- Greedy ids with TP=2 equal TP=1 and HF for each family, also on a second round
  served from the prefix cache, and with preemption and chunked prefill forced.
- Nothing is left behind: no worker process, no /dev/shm segment, not after
  `shutdown`, not after a failure, not at interpreter exit.
- A worker that dies or raises mid-run gives a TensorParallelError, not a hang
  (each such test is bounded by a watchdog that aborts the run if it hangs).
- Ranks start spawned (the default) or forked from one warm fork server
  (NANOVLLM_WORKER_MULTIPROC_METHOD=forkserver); any other value is refused.

The engines here start their ranks from the fork server (~0.5 s a start instead of ~4 s for
a spawned interpreter that imports torch on a 2-core machine); the default, "spawn", runs in
the two-engines test's child process, the shut-down recorder's group, and test_fp8_kv's and
test_structured_rounds' tensor-parallel engines.
"""
import faulthandler
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import shared_memory

import pytest
import torch
import torch.distributed as dist

from nanovllm import LLM, SamplingParams
from nanovllm.distributed import TensorParallelError
from nanovllm.distributed import shm_channel
from nanovllm.distributed.rank_group import START_METHOD_ENV, RankGroup
from nanovllm.distributed.shm_channel import REATTACH, ShmChannel
from nanovllm.engine.model_source import ModelSource
from nanovllm.models.registry import get_model_class
from nanovllm.utils.loader import iter_safetensors, load_named_weights
from nanovllm.utils.parallel import tensor_parallel
from tiny_models import build_tiny_model, hf_greedy, random_prompts
from tp_checks import SHM_DIR, ShutdownRecorder, assert_gone

TP = 2
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_kvcache_blocks=64)
HANG_LIMIT_S = 120  # a failure test that takes longer than this has hung: abort the run
KILL_DELAY_S = 0.3  # well inside the 200 decode steps of the killed-worker test
# Llama's tiny model is rebuilt with an odd vocabulary, so that the 2-way split pads it
# (the others keep 320 = 2 * 160); it also has one KV head, replicated on both ranks.
OVERRIDES = {"llama": dict(vocab_size=321)}


@pytest.fixture(scope="module")
def tp_model(tiny_model, tmp_path_factory):
    """tp_model(family) -> (dir, hf_model): the session's tiny model, or a variant (OVERRIDES)."""
    built = {}

    def get(family: str):
        if family not in OVERRIDES:
            return tiny_model(family)
        if family not in built:
            path = str(tmp_path_factory.mktemp(f"tp-{family}"))
            built[family] = (path, build_tiny_model(family, path, **OVERRIDES[family]))
        return built[family]
    return get


@pytest.fixture(autouse=True)
def ranks_from_the_fork_server(monkeypatch):
    """Every engine of this module forks its ranks from the fork server, unless its test removes
    START_METHOD_ENV again (the default, spawn)."""
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _group(llm: LLM):
    return llm.llm_engine.model_runner.group


def _assert_no_group_here() -> None:
    """This process has no worker child left and no process group."""
    assert not mp.active_children()
    assert not dist.is_initialized()


@pytest.fixture
def watchdog():
    """Abort the whole run (with every thread's traceback) if the test hangs."""
    faulthandler.dump_traceback_later(HANG_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# ---- shards -----------------------------------------------------------------------

def _build_rank(path: str, rank: int, weights) -> torch.nn.Module:
    model_config = ModelSource.resolve(path).model_config()
    with tensor_parallel(rank, TP):
        model = get_model_class(model_config.architecture)(model_config, 256)
    load_named_weights(model, weights)
    return model


def _expected_shards(hf, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` of 2 must hold, spelled out in heads and rows of HF's own tensors."""
    cfg, w = hf.config, hf.state_dict()
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    q = slice(rank * heads // TP * d, (rank + 1) * heads // TP * d)
    kv_rank = rank if kv_heads % TP == 0 else rank * kv_heads // TP  # one KV head: replicated
    kv_per_rank = max(kv_heads // TP, 1) * d
    kv = slice(kv_rank * kv_per_rank, (kv_rank + 1) * kv_per_rank)
    inter = slice(rank * cfg.intermediate_size // TP, (rank + 1) * cfg.intermediate_size // TP)
    shard_rows = -(-cfg.vocab_size // TP)
    vocab = torch.zeros(shard_rows, cfg.hidden_size)
    own = w["model.embed_tokens.weight"][rank * shard_rows:(rank + 1) * shard_rows]
    vocab[:len(own)] = own  # the rest is padding, zero
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    if a + "qkv_proj.weight" in w:  # Phi-3 stores [q; k; v] and [gate; up] fused
        w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"] = \
            w[a + "qkv_proj.weight"].split([heads * d, kv_heads * d, kv_heads * d])
        w[m + "gate_proj.weight"], w[m + "up_proj.weight"] = w[m + "gate_up_proj.weight"].chunk(2)
    expected = {
        a + "qkv_proj.weight": torch.cat([w[a + "q_proj.weight"][q], w[a + "k_proj.weight"][kv],
                                          w[a + "v_proj.weight"][kv]]),
        a + "o_proj.weight": w[a + "o_proj.weight"][:, q],
        "model.embed_tokens.weight": vocab,
    }
    if m + "experts.gate_up_proj" in w:  # a sparse layer (HF holds [E, 2I, H] and [E, H, I])
        expected.update(_expected_expert_shards(w, m, rank))
    else:
        expected[m + "gate_up_proj.weight"] = torch.cat([w[m + "gate_proj.weight"][inter],
                                                         w[m + "up_proj.weight"][inter]])
        expected[m + "down_proj.weight"] = w[m + "down_proj.weight"][:, inter]
    if a + "q_proj.bias" in w:  # Qwen2
        expected[a + "qkv_proj.bias"] = torch.cat([w[a + "q_proj.bias"][q], w[a + "k_proj.bias"][kv],
                                                   w[a + "v_proj.bias"][kv]])
    return expected


def _expected_expert_shards(w: dict, m: str, rank: int) -> dict[str, torch.Tensor]:
    """A sparse layer on rank `rank`: the router whole, every expert's slice of its
    intermediate dimension (gate rows, up rows, down columns)."""
    gate, up = w[m + "experts.gate_up_proj"].chunk(2, dim=1)  # [E, I, H] each
    down = w[m + "experts.down_proj"]  # [E, H, I]
    share = down.shape[2] // TP
    inter = slice(rank * share, (rank + 1) * share)
    return {m + "gate.weight": w[m + "gate.weight"],
            m + "experts.w13_weight": torch.cat([gate[:, inter], up[:, inter]], dim=1),
            m + "experts.w2_weight": down[:, :, inter]}


@pytest.mark.parametrize("whole_tensors", [False, True], ids=["safetensors-slices", "whole-tensors"])
def test_each_rank_holds_its_shard(tp_model, family, whole_tensors):
    path, hf = tp_model(family)
    for rank in range(TP):
        weights = list(hf.state_dict().items()) if whole_tensors else iter_safetensors(path)
        model = _build_rank(path, rank, weights)
        params = dict(model.named_parameters())
        for name, expected in _expected_shards(hf, rank).items():
            assert torch.equal(params[name], expected), f"rank {rank}: {name}"
        if hf.config.tie_word_embeddings:  # one copy of the shard, shared by the LM head
            assert model.lm_head.weight is model.model.embed_tokens.weight
        else:
            assert torch.equal(model.lm_head.weight, _lm_head_shard(hf, rank))


def _lm_head_shard(hf, rank: int) -> torch.Tensor:
    rows = -(-hf.config.vocab_size // TP)
    shard = torch.zeros(rows, hf.config.hidden_size)
    own = hf.state_dict()["lm_head.weight"][rank * rows:(rank + 1) * rows]
    shard[:len(own)] = own
    return shard


def test_head_counts_that_do_not_split_are_rejected_before_any_process_starts(tp_model):
    path, _ = tp_model("qwen3")  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(path, tensor_parallel_size=3, **ENGINE)
    _assert_no_group_here()


def test_kv_heads_that_neither_split_nor_replicate_are_rejected(tmp_path):
    build_tiny_model("qwen2", str(tmp_path), num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) and tensor_parallel_size \(2\)"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)
    assert not mp.active_children()


# ---- greedy parity ------------------------------------------------------------------

def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


LOGPROBS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
LOGPROB_TOLERANCE = 1e-4  # fp32; TP sums the row-parallel partial products in another order


def _logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[list[tuple[int, float]]]]:
    """Per request, per position (prompt, then completion): (token id, logprob) sorted by id."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], LOGPROBS, use_tqdm=False)
    return [[sorted((t, lp.logprob) for t, lp in entry.items())
             for entry in out.prompt_logprobs[1:] + out.outputs[0].logprobs] for out in outs]


def _assert_logprobs_close(got, expected) -> None:
    assert [[[t for t, _ in e] for e in r] for r in got] == [[[t for t, _ in e] for e in r] for r in expected]
    values = torch.tensor([lp for r in got for e in r for _, lp in e])
    assert torch.allclose(values, torch.tensor([lp for r in expected for e in r for _, lp in e]),
                          atol=LOGPROB_TOLERANCE, rtol=0)


def test_tp2_matches_tp1_and_hf(tp_model, family):
    path, hf = tp_model(family)
    prompts = random_prompts([5, 17, 33])
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(ref)) >= 6 for ref in refs)  # varied continuations, not one repeated token
    with LLM(path, **ENGINE) as llm:
        assert _generate(llm, prompts) == refs
        tp1_logprobs = _logprobs(llm, prompts)
    # second round: the first prompts extended, so their full blocks come from the prefix cache
    longer = [p + q for p, q in zip(prompts, random_prompts([20, 20, 20], seed=1))]
    longer_refs = [hf_greedy(hf, p, NEW_TOKENS) for p in longer]
    with LLM(path, tensor_parallel_size=TP, **ENGINE) as llm:
        group = _group(llm)
        pids, shm_names = group.pids, [group._res.channel.shm.name]
        assert _generate(llm, prompts) == refs
        outs = llm.generate(longer, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == longer_refs
        assert sum(o.num_cached_tokens for o in outs) >= 16  # at least one block was a cache hit
        _assert_logprobs_close(_logprobs(llm, prompts), tp1_logprobs)  # the LM head's gather, per prompt token
        assert llm.llm_engine.block_manager.num_free_blocks == 64
    assert_gone(pids, shm_names)
    _assert_no_group_here()


def test_tp2_with_preemption_chunked_prefill_and_a_growing_channel(tp_model, monkeypatch):
    path, hf = tp_model("qwen2")  # qkv bias, untied embeddings
    monkeypatch.setattr(shm_channel, "INITIAL_BYTES", 256)  # the first prefill command must grow it
    prompts = random_prompts([40, 50, 60], seed=2)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    # 8 blocks of 16 tokens: each sequence alone needs up to 6, all three together 17
    with LLM(path, tensor_parallel_size=TP, **{**ENGINE, "num_kvcache_blocks": 8, "max_model_len": 128},
             max_num_batched_tokens=32) as llm:
        group = _group(llm)
        first_segment = group._res.channel.shm.name
        assert _generate(llm, prompts) == refs
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert group._res.channel.shm.size > 256
        assert not os.path.exists(os.path.join(SHM_DIR, first_segment))  # the outgrown one is gone
        pids, shm_names = group.pids, [group._res.channel.shm.name]
    assert_gone(pids, shm_names)
    _assert_no_group_here()


def test_gguf_tensors_are_sliced_after_dequantizing(tmp_path):
    """Quantized blocks do not split at shard boundaries: each rank dequantizes whole tensors
    (and un-permutes Llama's q/k) and keeps its slice. TP=2 must give TP=1's tokens."""
    pytest.importorskip("gguf")
    from test_gguf import write_tiny_gguf
    hf = build_tiny_model("llama", str(tmp_path / "hf"), rope_scaling=None)  # HF's GGUF reader drops it
    path = str(tmp_path / "tiny-llama.gguf")
    write_tiny_gguf(hf, "llama", path, quantize=True)
    prompts = random_prompts([5, 17, 33])
    with LLM(path, **ENGINE) as llm:
        expected = _generate(llm, prompts)
    assert len(set(expected[0])) >= 6
    with LLM(path, tensor_parallel_size=TP, **ENGINE) as llm:
        assert _generate(llm, prompts) == expected
    _assert_no_group_here()


# ---- failures and clean exits ------------------------------------------------------

@pytest.mark.parametrize("when", ["between-steps", "any-time"])
def test_a_killed_worker_gives_an_error_not_a_hang(tp_model, watchdog, when):
    path, _ = tp_model("qwen3")
    llm = LLM(path, tensor_parallel_size=TP, **ENGINE)
    group = _group(llm)
    pids, shm_names = group.pids, [group._res.channel.shm.name]
    engine = llm.llm_engine
    for prompt in random_prompts([9, 30]):
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()  # mid-run: prompts computed, decoding under way
    if when == "between-steps":  # the worker waits for its next command
        os.kill(pids[0], signal.SIGKILL)
    else:  # most likely inside a step's collectives
        threading.Timer(KILL_DELAY_S, os.kill, (pids[0], signal.SIGKILL)).start()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) died during 'run'"):
        while engine.has_unfinished_requests():
            engine.step()
    assert_gone(pids, shm_names)
    _assert_no_group_here()
    with pytest.raises(TensorParallelError, match="has stopped"):
        engine.step()
    llm.shutdown()  # still fine after the failure


def test_a_worker_that_raises_is_reported_with_its_traceback(tp_model, watchdog):
    path, _ = tp_model("qwen3")
    with LLM(path, tensor_parallel_size=TP, **ENGINE) as llm:
        group = _group(llm)
        pids, shm_names = group.pids, [group._res.channel.shm.name]
        llm.llm_engine.add_request(None, random_prompts([12])[0], GREEDY)
        seqs = llm.llm_engine.scheduler.schedule()
        # rank 0 runs the real step (and waits in its first all-reduce); rank 1 gets
        # a batch it cannot read, raises, reports and leaves
        with pytest.raises(TensorParallelError, match=r"(?s)rank 1 .* raised during 'run'.*AttributeError"):
            group.call("run", (seqs,), ([None],))
    assert_gone(pids, shm_names)
    _assert_no_group_here()


def test_a_failure_at_start_up_leaves_nothing(tp_model, watchdog, monkeypatch):
    path, _ = tp_model("qwen3")
    created = []   # every segment this process makes (not another process's, as a second xdist worker's)

    class RecordedSharedMemory(shared_memory.SharedMemory):
        def __init__(self, name=None, create=False, size=0, **kwargs):
            super().__init__(name, create, size, **kwargs)
            if create:
                created.append(self.name)
    monkeypatch.setattr(shared_memory, "SharedMemory", RecordedSharedMemory)
    with pytest.raises(ValueError, match="KV cache too small"):  # every rank finds it too small
        LLM(path, tensor_parallel_size=TP, **{**ENGINE, "num_kvcache_blocks": 2})
    _assert_no_group_here()
    assert created, "the start-up made no segment to check"
    assert_gone([], created)


def test_every_rank_shuts_its_object_down_before_the_group_goes(tmp_path, watchdog, monkeypatch):
    """(On a GPU, CUDA graphs that captured NCCL collectives are dropped there first.) With the
    default start method: the worker is this process's own spawned child."""
    monkeypatch.delenv(START_METHOD_ENV)
    group = RankGroup(TP, torch.device("cpu"), ShutdownRecorder, str(tmp_path))
    assert _parent_pid(group.pids[0]) == os.getpid()
    group.shutdown()
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "True", "1": "True"}
    _assert_no_group_here()


def test_forkserver_ranks_fork_from_one_server_and_leave_nothing(tmp_path, watchdog):
    """Two groups in turn: each worker is a child of the same fork server, not of this process;
    each shuts down as a spawned one does."""
    servers = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        group = RankGroup(TP, torch.device("cpu"), ShutdownRecorder, str(tmp_path / str(i)))
        pids, shm_names = group.pids, [group._res.channel.shm.name]
        servers.append(_parent_pid(pids[0]))
        group.shutdown()
        assert {p.name: p.read_text() for p in (tmp_path / str(i)).iterdir()} == {"0": "True", "1": "True"}
        assert_gone(pids, shm_names)
        _assert_no_group_here()
    assert servers[0] == servers[1] != os.getpid()


def test_an_unknown_start_method_is_refused_before_any_process_starts(tp_model, monkeypatch):
    path, _ = tp_model("qwen3")
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=rf"{START_METHOD_ENV}='fork': use one of spawn, forkserver"):
        LLM(path, tensor_parallel_size=TP, **ENGINE)
    _assert_no_group_here()


EXIT_SCRIPT = textwrap.dedent("""
    import sys
    from nanovllm import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", skip_tokenizer_init=True,
                  max_model_len=256)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        group = llm.llm_engine.model_runner.group
        print(group.pids[0], group._res.channel.shm.name, out[0].outputs[0].token_ids, flush=True)
        # no shutdown: interpreter exit must stop the worker and remove the segment
""")


def test_two_engines_coexist_and_interpreter_exit_cleans_up(tp_model, watchdog):
    path, hf = tp_model("qwen3")
    prompt = random_prompts([11], seed=3)[0]
    with LLM(path, tensor_parallel_size=TP, **ENGINE) as llm:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        del env[START_METHOD_ENV]  # the child's engine spawns its rank (the default)
        child = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, path], capture_output=True, text=True,
                               timeout=HANG_LIMIT_S, env=env)
        assert child.returncode == 0, child.stderr
        pid, shm_name, tokens = child.stdout.split(maxsplit=2)
        assert eval(tokens) == hf_greedy(hf, [5, 6, 7], 4)  # the other engine worked alongside
        assert_gone([int(pid)], [shm_name])
        assert _generate(llm, [prompt]) == [hf_greedy(hf, prompt, NEW_TOKENS)]  # and this one still works


def test_shm_channel_grows_for_a_command_larger_than_its_buffer():
    rank0 = ShmChannel.create(mp.get_context("spawn"), 1, size=4096)
    worker = ShmChannel.attach(*rank0.worker_handle(0))
    names = [rank0.shm.name]

    def worker_switches():  # what a worker does on the reattach command
        method, args = worker.receive(lambda: True)
        assert method == REATTACH
        getattr(worker, method)(*args)
    big = ("run", (list(range(10_000)),))  # ~30 KB pickled
    rank0.send(big, worker_switches)
    names.append(rank0.shm.name)
    assert worker.receive(lambda: True) == big
    assert rank0.shm.size >= 30_000 and worker.shm.name == rank0.shm.name
    assert not os.path.exists(os.path.join(SHM_DIR, names[0]))
    rank0.send(("small", ()), lambda: None)  # later commands use the new segment
    assert worker.receive(lambda: True) == ("small", ())
    worker.close()
    rank0.close()
    assert not os.path.exists(os.path.join(SHM_DIR, names[1]))


def test_a_waiting_worker_notices_that_rank0_is_gone():
    rank0 = ShmChannel.create(mp.get_context("spawn"), 1, size=4096)
    worker = ShmChannel.attach(*rank0.worker_handle(0))
    start = time.monotonic()
    assert worker.receive(lambda: False) is None
    assert time.monotonic() - start < 2 * shm_channel.WAIT_POLL_S
    worker.close()
    rank0.close()
