"""Python imports this at start-up where this folder is on PYTHONPATH: bench_cpu.py --isa avx2 puts it
there for vLLM's CPU backend (its venv's python and the engine process it starts). torch then answers
as on a CPU without AVX512 or AMX, and vLLM loads the kernels it built for AVX2 (vllm/_C_AVX2: its
platforms/cpu.py `import_kernels`) and picks its attention kernels as it would there. torch's own
kernels and oneDNN's follow ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA, set by bench_cpu.py."""
import torch

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
