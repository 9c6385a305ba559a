"""What the loop knows of the executor serving it, built from that executor's Hello.

The same Hello describes an executor that registered just now and a warm standby the
link kept aside until the loop lost its executor (scheduler_svc/link.py): either way
the core attaches the model it announces.
"""

from __future__ import annotations

import dataclasses

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import CostModel, ModelInfo


@dataclasses.dataclass
class ExecutorInfo:
    incarnation: str
    model_id: str
    model: ModelInfo
    pid: int

    @classmethod
    def from_hello(cls, hello: pb.Hello) -> ExecutorInfo:
        model = ModelInfo(
            block_size=hello.block_size,
            num_blocks=hello.num_device_blocks,
            max_model_len=hello.max_model_len,
            vocab_size=hello.vocab_size,
            eos_token_ids=frozenset(hello.eos_token_ids),
            num_host_blocks=hello.num_host_blocks, kv_window=hello.kv_window,
            cost=CostModel(hello.prefill_tokens_per_s, hello.swap_bytes_per_s,
                           hello.block_bytes),
        )
        return cls(hello.incarnation, hello.model_id, model, hello.pid)
