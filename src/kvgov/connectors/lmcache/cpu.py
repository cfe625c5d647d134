"""A CPU stand-in for the GPU paged KV cache, so a real LMCache engine runs without a GPU.

LMCache ships no CPU "GPU connector" that moves bytes (its ``MockGPUConnector`` does nothing).
:class:`CpuKVConnector` implements LMCache's ``GPUConnectorInterface`` over a CPU tensor shaped
``[2, layers, slots, heads * head_dim]`` addressed through a ``slot_mapping``; everything else
(the engine, its tiers, the kvgov connector) is LMCache's real code. Used by ``kvgov demo`` and
the test suite; never by a production engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata


class CpuKVConnector(GPUConnectorInterface):  # type: ignore[misc]
    """KV "GPU" memory as a CPU tensor ``[2, layers, slots, hidden]``."""

    def __init__(self, layers: int, hidden: int, slots: int, dtype: torch.dtype) -> None:
        self.layers = layers
        self.hidden = hidden
        self.kv = torch.zeros((2, layers, slots, hidden), dtype=dtype)

    @staticmethod
    def _slots(kwargs: Mapping[str, Any], start: int, end: int) -> torch.Tensor:
        return torch.as_tensor(kwargs["slot_mapping"], dtype=torch.long)[start:end]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self.kv[:, :, self._slots(kwargs, start, end), :])
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.kv[:, :, self._slots(kwargs, start, end), :] = memory_obj.tensor

    def batched_from_gpu(
        self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        for obj, start, end in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])


def cpu_metadata(
    model: str, *, layers: int, heads: int, head_dim: int, dtype: torch.dtype, chunk: int = 256
) -> LMCacheMetadata:
    """Single-worker metadata for a CPU engine of that geometry."""
    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(layers, 2, chunk, heads, head_dim),
        chunk_size=chunk,
        role="worker",
    )
