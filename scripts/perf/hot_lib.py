"""Shared by hot_step_cost.py and hot_callgrind.py: the 64 shards' packed-v2 watermarks of a
test instance, uniform at W = 0 (the 19-byte form: presence, W, floor, W; ADR-0015)."""


def blob(w):
    """The uniform packed-v2 lane record at W = w, floor 0."""
    b = w.to_bytes(6, "big")
    return b"\x01" + b + (0).to_bytes(6, "big") + b


def init_watermarks(r, epoch, shards=64):
    """Writes wm:{s} for s in 0..shards at W = 0 with `epoch`; returns every shard's W (0)."""
    for s in range(shards):
        r.cmd("HSET", "wm:{%d}" % s, "wm_layout", "packed-v2", "wm_epoch", str(epoch), "wm_blob", blob(0))
    return [0] * shards
