"""Shared test set-up.

TRITON_INTERPRET must be set before anything imports triton (kernels then run on the CPU in the
interpreter); VLLM_* defaults keep engines in-process and small.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
