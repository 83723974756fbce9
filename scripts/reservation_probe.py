"""vLLM's scheduler probed for the address rule: integration.run_generation in this process's engine
(--multiprocessing 0), and at every step of vLLM's own scheduler every scheduled request's pages checked,
in every KV-cache group: at least ceil(reserved / block_size) of them, distinct, never vLLM's null block,
shared with no other request of the step. Under policy off a group on vLLM's sliding-window manager is
vLLM's business (it frees out-of-window pages and puts its null block in their entries): the probe only
counts those entries (``freed_entries``). Used by tests/test_reservation.py and tests/test_e2e_windowed.py
(vLLM 0.32 CPU) and on the GPU machine (0.24):

    PROBE_OUT=probe.json python3 scripts/reservation_probe.py --model DIR \
        --backend DHP --policy strict --multiprocessing 0 --batching together

The report's top-level fields are the first engine's; ``runs`` has one entry per engine ("model|policy")
when run_generation runs several.
"""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from dhp_backend.config import DHPConfig, Policy
from dhp_backend.ops.buckets import reserved_tokens

runs = {}
original = Scheduler.schedule

def schedule(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    policy = DHPConfig.from_sources(self.vllm_config.additional_config).policy
    key = f"{self.vllm_config.model_config.model}|{policy.value}"
    report = runs.setdefault(key, {"steps": 0, "requests": 0, "max_blocks": 0, "hooked": None, "groups": 0,
                                   "freed_entries": 0, "violations": []})
    mgr, mml = self.kv_cache_manager, self.max_model_len
    groups = self.kv_cache_config.kv_cache_groups
    report["hooked"] = type(mgr.allocate_slots).__name__
    report["groups"] = len(groups)
    owner = {}
    for req_id in out.num_scheduled_tokens:
        seq = self.requests[req_id].num_computed_tokens
        for g, ids in enumerate(mgr.get_block_ids(req_id)):
            ids = list(ids)
            bs = groups[g].kv_cache_spec.block_size
            need = -(-reserved_tokens(policy, seq, mml) // bs)
            report["max_blocks"] = max(report["max_blocks"], len(ids))
            if policy is Policy.OFF and isinstance(groups[g].kv_cache_spec, SlidingWindowSpec):
                report["freed_entries"] += ids.count(0)
                continue
            real = [b for b in ids if b != 0]
            shared = [b for b in real if (g, b) in owner]
            if len(ids) < need or 0 in ids[:need] or len(set(real)) != len(real) or shared:
                report["violations"].append({"req": req_id, "group": g, "seq": seq, "need": need, "ids": ids,
                                             "shared": shared})
            owner.update(((g, b), req_id) for b in real)
    report["steps"] += 1
    report["requests"] = max(report["requests"], len(out.num_scheduled_tokens))
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({**next(iter(runs.values())), "runs": runs}, f)
    return out

Scheduler.schedule = schedule
from integration.run_generation import main
main(sys.argv[1:])
