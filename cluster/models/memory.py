"""What one hosted model costs in device memory: KV bytes per cached token, weight bytes, and the memory of
the device it lives on (with the *domain* that memory belongs to: models in one domain share it).

The engine turns these reports into its default KV budget (:mod:`cluster.engine.kv_budget`), as vLLM sizes
its KV cache from ``gpu_memory_utilization`` after loading the weights.  KV bytes per token follow the
attention's shape: ``2 (K and V) x layers x key/value heads x head_dim x dtype bytes``, divided over the ranks
of a tensor-parallel group (each rank holds its heads' share).  Sliding-window layers are counted at full
length (an upper bound: they hold at most their window).
"""
from __future__ import annotations

import os
import socket

import torch


def kv_bytes_per_token(config, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of K and V one cached position costs across all layers of ``config`` (a transformers config)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    per_rank_heads = max(1, kv_heads // max(1, tp_size))
    return 2 * int(c.num_hidden_layers) * per_rank_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def device_memory(device: torch.device) -> tuple[int, str]:
    """(total bytes, domain) of ``device``: a GPU's own memory, or the host's RAM for the CPU (shared by every
    process on the host)."""
    host = socket.gethostname()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{host}:cuda:{getattr(props, 'uuid', device.index)}"
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), f"{host}:cpu"


def memory_report(model: torch.nn.Module) -> dict:
    """The report of a loaded model (this process's shard of it under tensor parallelism)."""
    param = next(model.parameters())
    tp = torch.distributed.get_world_size() if torch.distributed.is_available() and \
        torch.distributed.is_initialized() else 1
    total, domain = device_memory(param.device)
    return dict(kv_bytes_per_token=kv_bytes_per_token(model.config, param.dtype, tp),
                weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                memory_bytes=total, domain=domain)
