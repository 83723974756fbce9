"""One request's content for the test-step builders (`tests/triton_steps.py`, `audit/bits.py`): its own
query rows and its K/V for every position up to its length."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Request:
    q: object  # [q_len, H, D] tensor
    k: object  # [seq_len, Hkv, D]
    v: object  # [seq_len, Hkv, D]

    @property
    def q_len(self) -> int:
        return self.q.shape[0]

    @property
    def seq_len(self) -> int:
        return self.k.shape[0]
