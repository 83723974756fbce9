"""What the KV-page reservation of a policy costs in capacity (pure arithmetic; no vLLM): the numbers and the
lines of the start-up report (`dhp_backend.startup_report`, in the engine and in ``dhp-backend info``) and
``dhp-backend info``'s table. The reservation itself, in vLLM's scheduler, is `dhp_backend.vllm.reservation`;
how many tokens' pages each policy holds is `dhp_backend.ops.buckets.reserved_tokens`."""

from __future__ import annotations

from dhp_backend.config import Policy
from dhp_backend.ops.buckets import next_pow2, reserved_tokens


def _blocks(tokens: int, block_size: int) -> int:
    return -(-int(tokens) // int(block_size))


def reservation_price(policy: Policy | str, *, max_model_len: int, block_size: int,
                      num_blocks: int | None) -> dict:
    """What the reservation costs in KV-cache capacity (pure arithmetic; no vLLM).

    ``num_blocks``: the KV cache's blocks as vLLM counts them (its null block,
    block 0, included: a request can get ``num_blocks - 1``); None leaves the
    capacities out. ``rows``: for bands of lengths ``(P/2, P]`` between powers of
    two, from ``max_model_len`` down, the tokens each policy holds per request
    of such a length and how many such requests fit in the cache at once.
    """
    policy = Policy.parse(policy)
    max_model_len, block_size = int(max_model_len), int(block_size)
    if max_model_len <= 0 or block_size <= 0:
        raise ValueError(f"max_model_len and block_size must be positive, got {max_model_len}, {block_size}")
    usable = None if num_blocks is None else max(0, int(num_blocks) - 1)

    def fit(tokens: int) -> int | None:
        return None if usable is None else usable // _blocks(tokens, block_size)

    def held(p: Policy, length: int) -> int:
        return reserved_tokens(p, length, max_model_len)

    rows = []
    hi = next_pow2(max_model_len)
    while len(rows) < 6:
        top, lo = min(hi, max_model_len), hi // 2 + 1  # lengths lo..top
        rows.append({
            "lengths": [lo, top],
            "tokens_held": {"strict": held(Policy.STRICT, top), "request": held(Policy.REQUEST, top),
                            "off": [lo, top]},
            "requests_at_once": {"strict": fit(held(Policy.STRICT, top)), "request": fit(held(Policy.REQUEST, top)),
                                 "off": [fit(top), fit(lo)]},
        })
        if hi <= max(2, block_size):
            break
        hi //= 2
    strict_blocks = _blocks(max_model_len, block_size)
    return {
        "policy": policy.value,
        "constant_time": policy.is_constant_time,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "num_blocks": None if num_blocks is None else int(num_blocks),
        "usable_blocks": usable,
        "reserved_per_request": {
            "strict": f"max_model_len = {max_model_len} tokens = {strict_blocks} blocks, from the first step",
            "request": (f"the next power of two of the length (at most 2x it, capped at {max_model_len}), "
                        "reserved again each time the length crosses one"),
            "off": "the true length (vLLM's own allocation)",
        }[policy.value],
        "strict_blocks_per_request": strict_blocks,
        "strict_requests_at_once": fit(max_model_len),
        "rows": rows,
    }


def _n(value) -> str:
    return "?" if value is None else f"{value:,}"


def price_lines(price: dict) -> list[str]:
    """The reservation, the capacity it leaves and what the other policies would give: three lines of
    the start-up report (`dhp_backend.startup_report`), in the engine and in ``dhp-backend info``."""
    policy, mml, bs = price["policy"], price["max_model_len"], price["block_size"]
    strict_blocks, strict_fit = price["strict_blocks_per_request"], _n(price["strict_requests_at_once"])
    if price["num_blocks"] is None:
        cache = "KV cache size not given"
    else:
        blocks = "block" if price["num_blocks"] == 1 else "blocks"
        cache = (f"KV cache: {_n(price['num_blocks'])} {blocks} of {bs} tokens ({_n(price['usable_blocks'])} "
                 "usable; block 0 is vLLM's null block)")
    if price.get("groups", 1) > 1:
        cache += (f"; {price['groups']} KV-cache groups (a hybrid model): the figures are for the first one, "
                  "and every group reserves alike")
    if price.get("kept_windows") and policy != "off":
        cache += (f"; Windowed layers (window {', '.join(map(str, price['kept_windows']))}) are managed as full "
                  "attention under this policy: they hold every page up to the bucket too, so their window saves "
                  "no KV memory (policy 'off' keeps vLLM's sliding-window manager, which frees out-of-window pages)")
    bands = ", ".join(f"{_n(r['requests_at_once']['request'])} of {r['lengths'][0]}-{r['lengths'][1]} tokens"
                      for r in price["rows"][:4])
    rule = "(the address rule: the kernels read every page up to the bucket)"
    if policy == "strict":
        plural = "" if price["strict_requests_at_once"] == 1 else "s"
        return [f"KV reservation: policy 'strict' holds max_model_len={mml} tokens = {strict_blocks} blocks of "
                f"{bs} per request from its first step, whatever its length {rule}",
                f"capacity: {cache} -> " + (
                    f"at most {strict_fit} request{plural} at once at this max_model_len"
                    if price["strict_requests_at_once"] != 0 else
                    "not one request fits at this max_model_len (vLLM refuses to start with a KV cache smaller "
                    "than max_model_len: lower max_model_len or give the cache more memory)"),
                f"instead: policy 'request' would hold each request's next power of two of its length (at most "
                f"2x the length; its log2 becomes public to timing): {bands} at once"]
    if policy == "request":
        return [f"KV reservation: policy 'request' holds the next power of two of each request's length (at "
                f"most 2x the length, capped at max_model_len={mml}), reserved again each time the length "
                f"crosses one {rule}",
                f"capacity: {cache} -> requests at once: {bands}",
                f"instead: policy 'strict' (no length public) would hold {strict_blocks} blocks per request: "
                f"{strict_fit} at once"]
    return ["KV reservation: none beyond each request's true length (policy 'off': vLLM's own allocation)",
            f"capacity: {cache} -> as many requests as their true lengths fit",
            f"instead: the constant-time policies hold more: 'strict' {strict_blocks} blocks per request "
            f"({strict_fit} at once), 'request' the next power of two of the length: {bands} at once"]


def price_table(price: dict) -> list[str]:
    """`reservation_price`'s rows as aligned text lines (``dhp-backend info``)."""
    lines = [f"{'length':>11}  {'tokens held: strict':>19} {'request':>8} {'off':>11}  "
             f"{'requests at once: strict':>24} {'request':>8} {'off':>13}"]
    for r in price["rows"]:
        lo, hi = r["lengths"]
        held, fit = r["tokens_held"], r["requests_at_once"]
        off_fit = "?" if fit["off"][0] is None else f"{_n(fit['off'][0])}-{_n(fit['off'][1])}"
        lines.append(f"{f'{lo}-{hi}':>11}  {held['strict']:>19} {held['request']:>8} {f'{lo}-{hi}':>11}  "
                     f"{_n(fit['strict']):>24} {_n(fit['request']):>8} {off_fit:>13}")
    return lines
