"""Start-up to ready of the demo-model engine with an empty persistent compilation cache (issue 23: background
compiles; docs/engine.md "Programs", results benchmarks/results/engine_startup_cpu_20261207_s30_*.json).

  python3 scripts/engine_startup.py <repo root> <empty cache dir> [EngineConfig fields as k=v ...]

e.g. ``background_compile=False`` for the engine that compiles every program first. Prints one JSON object: seconds
to a built engine (ready to serve), to every program available (``wait_for_programs``), and the compile events
of >= 0.3 s with their threads."""
import json
import logging
import sys
import threading
import time

root, cache = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
kw = {}
for a in sys.argv[3:]:
    k, v = a.split("=")
    kw[k] = {"True": True, "False": False}.get(v, v)
t0 = time.perf_counter()
import jax
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
from jax import monitoring
events = []
def on(ev, dur, **k):
    if ev.startswith("/jax/core/compile/") or ev.startswith("/jax/compilation_cache"):
        events.append((round(time.perf_counter() - t0, 1), threading.current_thread().name, ev.rsplit("/", 1)[-1], k.get("fun_name"), round(dur, 2)))
monitoring.register_event_duration_secs_listener(on)
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f %(threadName)s %(message)s")
import dsflash
from dsflash.serve.engine import LLMEngine
t1 = time.perf_counter()
m = dsflash.load("demo")
t2 = time.perf_counter()
eng = LLMEngine(m, max_num_seqs=8, max_model_len=256, page_size=64, max_num_batched_tokens=128,
                prefill_buckets=[(4, 32)], enable_prefix_caching=False, decode_steps=4, **kw)
t3 = time.perf_counter()
out = {"root": root, "kw": kw, "import_s": t1 - t0, "load_s": t2 - t1, "engine_build_s": t3 - t2,
       "ready_since_start_s": t3 - t0, "warmup_time_s": eng.warmup_time}
wait = getattr(eng, "wait_for_programs", None)
if wait is not None:
    wait()
    out["all_programs_since_start_s"] = time.perf_counter() - t0
out["events"] = [e for e in events if e[4] >= 0.3]
print(json.dumps(out, indent=1))
