"""Fault injection shared by the tests: code a test puts in a `sitecustomize.py` on the
workers' PYTHONPATH, so the real workload misbehaves at a chosen moment."""

# Saves from step 4 on write half of a shard file, then stall: the window in which a test kills the
# job (kill -9 of the workers, or of the whole node) to leave a torn checkpoint behind. DCP writes
# each tensor with torch.save into a wrapper (`.raw`) of the shard file, which lies in the save's
# staging directory `.step_00000004.tmp-<token>/` (workloads.checkpoint); in the writer thread too
# under --async-checkpoint.
HALF_WRITTEN_SAVE = """
    import io, time, torch
    _save = torch.save
    def save(obj, f, *a, **k):
        raw = getattr(f, "raw", f)
        staging = str(getattr(raw, "name", "")).rsplit("/", 2)[-2:-1]
        if staging and staging[0].startswith(".step_") and staging[0][6:14] >= "00000004":
            buf = io.BytesIO()
            _save(obj, buf, *a, **k)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            raw.flush()
            time.sleep(120)
            f.write(data[len(data) // 2:])
            return
        return _save(obj, f, *a, **k)
    torch.save = save
"""

# Every training step of a worker takes SLOW_STEP_S longer, asleep (no CPU): a run of few steps
# still lasts long enough for a test to lose a node before its end, and the steps' arithmetic is
# unchanged (a run without it ends with the same parameters).
SLOW_STEP_S = 0.1
SLOW_STEPS = f"""
    import os
    if "LOCAL_RANK" in os.environ:
        import time, torch
        _step = torch.optim.AdamW.step
        def step(self, *a, **k):
            time.sleep({SLOW_STEP_S})
            return _step(self, *a, **k)
        torch.optim.AdamW.step = step
"""
