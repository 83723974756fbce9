"""vLLM's scheduler probed for the address rule: integration.run_generation in this process's engine
(--multiprocessing 0), and at every step of vLLM's own scheduler every scheduled request's pages checked:
at least ceil(reserved / block_size) of them, distinct, never vLLM's null block, shared with no other
request of the step. Used by tests/test_reservation.py (vLLM 0.32 CPU) and on the GPU machine (0.24):

    PROBE_POLICY=strict PROBE_OUT=probe.json python3 scripts/reservation_probe.py --model DIR \
        --backend DHP --policy strict --multiprocessing 0 --batching together
"""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from vllm.v1.core.sched.scheduler import Scheduler
from dhp_backend.ops.buckets import reserved_tokens

report = {"steps": 0, "requests": 0, "max_blocks": 0, "hooked": None, "violations": []}
policy = os.environ["PROBE_POLICY"]
original = Scheduler.schedule

def schedule(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    mgr, bs, mml = self.kv_cache_manager, self.block_size, self.max_model_len
    report["hooked"] = type(mgr.allocate_slots).__name__
    owner = {}
    for req_id in out.num_scheduled_tokens:
        ids = list(mgr.get_block_ids(req_id)[0])
        seq = self.requests[req_id].num_computed_tokens
        need = -(-reserved_tokens(policy, seq, mml) // bs)
        report["max_blocks"] = max(report["max_blocks"], len(ids))
        shared = [b for b in ids if b in owner]
        if len(ids) < need or 0 in ids[:need] or len(set(ids)) != len(ids) or shared:
            report["violations"].append({"req": req_id, "seq": seq, "need": need, "ids": ids,
                                         "shared": shared})
        owner.update((b, req_id) for b in ids)
    report["steps"] += 1
    report["requests"] = max(report["requests"], len(out.num_scheduled_tokens))
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(report, f)
    return out

Scheduler.schedule = schedule
from integration.run_generation import main
main(sys.argv[1:])
