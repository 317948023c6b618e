"""Fault injection shared by the tests: code a test puts in a `sitecustomize.py` on the
workers' PYTHONPATH, so the real workload misbehaves at a chosen moment."""

# Saves from step 4 on write half the file, then stall: the window in which a test kills the job
# (kill -9 of the workers, or of the whole node) to leave a torn checkpoint behind.
HALF_WRITTEN_SAVE = """
    import io, time, torch
    _save = torch.save
    def save(obj, f, *a, **k):
        name = str(getattr(f, "name", "")).rsplit("/", 1)[-1]
        if name.startswith(".step_") and name[6:14] >= "00000004":
            buf = io.BytesIO()
            _save(obj, buf, *a, **k)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(120)
            f.write(data[len(data) // 2:])
            return
        return _save(obj, f, *a, **k)
    torch.save = save
"""
