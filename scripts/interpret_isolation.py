"""One fresh process per interpreter check, a failed check re-run once (shared by the triton_interpret_* scripts).

Why: repeated Triton-interpreter launches within one process were seen (2026-11-30) to return garbage now and then
(wholly wrong but repeatable outputs, stores never landing, once "free(): invalid pointer"), also with the old
kernels; cause not found. Used by every triton_interpret_* script: each check runs as
``python <script> --check <name>`` in a new process; a failed check is run once more in another new process and
the retry is printed loudly. A real bug must not hide behind the retry, so the run still fails if a re-run fails,
or if more than one check needed a re-run. Deliberately light (no jax / triton import): the parent only dispatches.
Startup: the children share a JAX persistent compilation cache in a temporary directory (most of a fresh process's
time was XLA compiling the eager ops of input generation and the reference: ~5.7 s -> ~1.9 s a check).
"""
import os
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 900     # one check; a hung interpreter counts as a failed attempt


def allow_runtime_loop_bounds():
    """Let interpreted kernels loop to a runtime scalar (``range(0, n, B)`` with ``n`` loaded in the kernel): the
    interpreter holds a scalar as a 1-element array and ``range`` calls ``int()`` on it, which numpy >= 2 refuses for
    a 1-d array ("only 0-dimensional arrays ..."). Same conversion, via ``.item()``. Compiled kernels are not
    affected. Imports triton, so a script calls it itself (this module stays light for the parent)."""
    import triton.runtime.interpreter as interp
    patch = interp._patch_lang_tensor
    if getattr(patch, "_runtime_bounds", False):
        return

    def with_index(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    with_index._runtime_bounds = True
    interp._patch_lang_tensor = with_index


def _attempt(script, name, env):
    """(ok, stdout, why) of one fresh-process run of check ``name``."""
    try:
        r = subprocess.run([sys.executable, script, "--check", name], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, out, f"timed out after {TIMEOUT_S} s"
    if r.returncode == 0:
        return True, r.stdout, ""
    err = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return False, r.stdout, f"rc {r.returncode}: " + (err[-1][:300] if err else "(no stderr)")



def expect(run, cfg_fn, label, kw, expect_ok=True):
    """A check that calls ``run(cfg_fn(), label=label, **kw)`` -> (ok, message), prints the message and asserts ok ==
    ``expect_ok`` (False for a mutant: the check must catch it, else it is vacuous)."""
    def f():
        ok, msg = run(cfg_fn(), label=label, **kw)
        print(msg + ("" if expect_ok else f"  -> {'passed (BAD: vacuous)' if ok else 'caught, as it must be'}"))
        assert ok == expect_ok, msg
    return f

def run_checks(script, names):
    """Run every check of ``script`` in its own process (see the module doc); print each check's output, the
    retries, and a summary line; exit non-zero on failure."""
    with tempfile.TemporaryDirectory(prefix="jax_cc_") as cache:
        env = dict(os.environ)
        if "JAX_COMPILATION_CACHE_DIR" not in env:
            env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        _run_all(script, names, env)


def _run_all(script, names, env):
    retried, failed = [], []
    t0 = time.time()
    for name in names:
        for attempt in range(2):
            t = time.time()
            ok, out, why = _attempt(script, name, env)
            body = [ln for ln in out.splitlines() if ln.strip()]
            if ok:
                tag = f"   [PASSED ON RETRY: {name}]" if attempt else ""
                print("\n".join(body) + tag + f"   ({time.time() - t:.1f} s)", flush=True)
                break
            head = "RETRY" if attempt == 0 else "FAILED AGAIN"
            print(f"{head}: check {name} attempt {attempt} FAILED ({why}); its output: " + " | ".join(body[-3:]),
                  flush=True)
            if attempt == 0:
                retried.append(name)
        else:
            failed.append(name)
    print(f"{len(names)} checks in fresh processes, {time.time() - t0:.0f} s; "
          f"retried: {retried or 'none'}; failed twice: {failed or 'none'}", flush=True)
    if failed:
        raise SystemExit(f"FAILED: check(s) {failed} failed in two fresh processes (a real bug, not the flake)")
    if len(retried) > 1:
        raise SystemExit(f"FAILED: {len(retried)} checks needed a re-run ({retried}); more than one is treated "
                         "as a bug, not the interpreter flake")
    if retried:
        print(f"WARNING: RETRIED check {retried[0]} (failed once, passed in a fresh process: interpreter flake, "
              "see dsflash/kernels/NOTES.md 'Known flake')", flush=True)


def main(script, checks):
    """Script entry: ``--check NAME`` runs one check in this process, ``--list`` lists them, no argument runs all
    isolated. ``checks``: ordered {name: zero-argument callable that asserts}."""
    argv = sys.argv[1:]
    if argv[:1] == ["--check"] and len(argv) == 2:
        checks[argv[1]]()
    elif argv == ["--list"]:
        print("\n".join(checks))
    elif not argv:
        run_checks(script, list(checks))
        print("ok")
    else:
        raise SystemExit(f"usage: {script} [--list | --check NAME]")
