"""The worker's copy of each running request: its NewRequest plus the deltas of every step since
(the invariant of tokenmill/step/). The model runner reads block tables, sampling parameters and token
histories here, so the scheduler sends each of them once."""
from __future__ import annotations

from tokenmill.sampling_params import SamplingParams
from tokenmill.step import NewRequest, SchedulerOutput
from tokenmill.step.multimodal import ImageInput


class RequestState:
    __slots__ = ("prompt_token_ids", "sampling_params", "eos_token_ids", "output_token_ids", "block_ids",
                 "lora_request", "mm_inputs")

    def __init__(self, new: NewRequest, num_kv_groups: int) -> None:
        self.prompt_token_ids: list[int] = new.prompt_token_ids
        self.sampling_params: SamplingParams = new.sampling_params
        self.eos_token_ids: list[int] = new.eos_token_ids
        self.output_token_ids: list[int] = list(new.output_token_ids)
        self.lora_request = new.lora_request
        self.mm_inputs: list[ImageInput] = new.mm_inputs  # images in the prompt (worker/multimodal.py)
        # per KV group, by position (an entry a sliding group gave back is stale: never read)
        self.block_ids: list[list[int]] = [[] for _ in range(num_kv_groups)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def tokens_before(self, pos: int) -> list[int]:
        """The request's first pos tokens (prompt, then output)."""
        p = self.prompt_token_ids
        return p[:pos] if pos <= len(p) else p + self.output_token_ids[:pos - len(p)]


class RequestStates(dict):
    """request id -> RequestState, kept in step with the scheduler by apply(). num_kv_groups: block tables per
    request (step/kv_groups.py)."""

    def __init__(self, num_kv_groups: int = 1) -> None:
        super().__init__()
        self.num_kv_groups = num_kv_groups

    def apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.pop(rid, None)
        for new in so.new_requests:
            self[new.request_id] = RequestState(new, self.num_kv_groups)
        for s in so.scheduled:
            st = self[s.request_id]
            for table, new_ids in zip(st.block_ids, s.new_block_ids):
                table.extend(new_ids)
            st.output_token_ids.extend(s.new_output_token_ids)
