"""The engine's start freezes the heap (llm_engine.freeze_startup_heap): what exists then is
out of the garbage collector's view, so full collections stay short while it serves."""
import gc
import weakref

from nanovllm import LLM, SamplingParams


def test_engine_start_freezes_the_heap(tiny_model):
    """What exists once an engine has started is out of the garbage collector's view (full
    collections stay short while it runs); what it makes later is collected as usual."""
    path, _ = tiny_model("qwen3")
    gc.unfreeze()
    llm = LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=128)
    runner, frozen = llm.llm_engine.model_runner, gc.get_freeze_count()
    assert frozen > 0
    assert not any(obj is runner for obj in gc.get_objects())  # the collector's generations skip it
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert gc.get_freeze_count() <= frozen  # nothing new frozen (frozen objects may be freed)
    assert any(obj is outs for obj in gc.get_objects())


class _Node:
    """A weak-referenceable object for a reference cycle."""


def test_a_later_engine_start_collects_what_an_earlier_one_froze():
    """Cycles frozen alive at one engine's start and dropped since (a whole earlier engine,
    say) are collected when the next engine starts, not only at exit."""
    from nanovllm.engine.llm_engine import freeze_startup_heap
    node = _Node()
    node.cycle = node
    alive = weakref.ref(node)
    freeze_startup_heap()
    del node
    gc.collect()
    assert alive() is not None  # frozen: the collector does not see the dropped cycle
    freeze_startup_heap()
    assert alive() is None
